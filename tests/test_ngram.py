"""Prompt lookup proposes what followed the latest earlier occurrence of the longest suffix."""

from __future__ import annotations

import torch

from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, NgramDrafter

CTX = DraftContext(SamplingParams(), None, torch.device("cpu"), 100)


def propose(drafter, context, k):
    draft = drafter.propose(context, k)
    assert draft.probs is None
    return draft.tokens.tolist()


def test_longest_match_wins_and_latest_occurrence_is_used():
    d = NgramDrafter("ng", CTX, 1, 3)
    # suffix (7, 8, 9) occurred at 1..3 followed by 10, 11; suffix (9,) alone later followed by 50
    context = [6, 7, 8, 9, 10, 11, 9, 50, 7, 8, 9]
    assert propose(d, context, 2) == [10, 11]
    d.reset()
    assert propose(d, [1, 2, 3, 9, 50, 51, 9, 60, 9], 2) == [60, 9]  # unigram 9: latest earlier use


def test_no_match_gives_an_empty_draft_and_short_tails_are_fine():
    d = NgramDrafter("ng", CTX, 2, 3)
    assert propose(d, [1, 2, 3, 4], 3) == []
    assert propose(d, [1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]


def test_index_grows_incrementally_and_resets_for_a_new_prompt():
    d = NgramDrafter("ng", CTX, 1, 2)
    context = [5, 6, 7]
    assert propose(d, context, 2) == []
    context += [5, 6]
    assert propose(d, context, 2) == [7, 5]
    assert propose(d, [1, 2], 2) == []  # shorter context: a new prompt, nothing stale used
