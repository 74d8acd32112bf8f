"""A prompt that starts with what the target's cache holds (a chat's next turn, a request
sharing a system prompt) prefills only the rest, and decodes exactly what a fresh cache
would: greedy output equals plain greedy decoding of the whole prompt."""

from __future__ import annotations

import pytest
import torch

from specdraft.core.sampling import SamplingParams
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, SuffixDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.policies.base import Policy
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.models.cached_lm import CachedLM
from tiny import VOCAB, plain_greedy, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def engine(target, drafters, policy: Policy, k: int = 3, max_new: int = 24, lean: bool = False):
    return SpeculativeEngine(CachedLM(target, lean=lean), drafters, policy,
                             EngineSettings(k, max_new, SamplingParams(), frozenset()))


def turns(eng, prompts):
    """Each prompt's committed tokens and the target tokens its prefill fed."""
    out = []
    for prompt in prompts:
        records = list(eng.generate(prompt))
        out.append(([t for r in records for t in r.tokens], records[0].times.prefill_tokens))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_next_turn_prefills_only_its_new_tokens_and_decodes_as_plain(target, seed):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), SuffixDrafter("suffix", ctx, SuffixOptions()),
                ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))]
    eng = engine(target, drafters, RandomPolicy([d.name for d in drafters], seed=seed))
    first = [5, 9, 14, 5, 9, 14, 3]
    (answer, fed), = turns(eng, [first])
    assert answer == plain_greedy(target, first, 24) and fed == len(first) - 1
    second = first + answer + [7, 8, 5, 9]  # the conversation so far, then the new turn
    (answer2, fed2), = turns(eng, [second])
    assert answer2 == plain_greedy(target, second, 24)
    assert fed2 == 4 - 1 + 1  # the new turn's tokens but its last (fed by the first verify), plus the
    # answer's last committed token, which the cache never held


def test_a_prompt_that_diverges_keeps_only_the_common_prefix(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3)]
    eng = engine(target, drafters, RandomPolicy(["lookup"], seed=0))
    turns(eng, [[5, 9, 14, 5, 9, 14, 3, 1, 2]])
    prompt = [5, 9, 14, 6, 6, 6]
    (answer, fed), = turns(eng, [prompt])
    assert fed == len(prompt) - 1 - 3 and answer == plain_greedy(target, prompt, 24)
    (again, fed_again), = turns(eng, [[17, 18]])  # nothing in common: a fresh prefill
    assert fed_again == 1 and again == plain_greedy(target, [17, 18], 24)


def test_the_lean_forward_reuses_its_buffer_exactly(target):
    from specdraft.models.lean.support import lean_problem

    if lean_problem(target) is not None:
        pytest.skip(lean_problem(target))
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3)]
    eng = engine(target, drafters, RandomPolicy(["lookup"], seed=0), lean=True)
    first = [5, 9, 14, 5, 9, 14, 3]
    (answer, _), = turns(eng, [first])
    second = first + answer + [7, 8]
    (answer2, fed), = turns(eng, [second])
    fresh = engine(target, drafters, RandomPolicy(["lookup"], seed=0), lean=True)
    (reference, _), = turns(fresh, [second])
    assert answer2 == reference and fed == 2


def test_a_cache_emptied_by_someone_else_is_not_reused(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    eng = engine(target, [NgramDrafter("lookup", ctx, 1, 3)], RandomPolicy(["lookup"], seed=0))
    first = [5, 9, 14, 5, 9, 14, 3]
    (answer, _), = turns(eng, [first])
    eng.target.reset()  # a cost probe between prompts
    eng.target.feed(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]), keep=0)
    second = first + answer + [7]
    (answer2, fed), = turns(eng, [second])
    assert fed == len(second) - 1 and answer2 == plain_greedy(target, second, 24)

