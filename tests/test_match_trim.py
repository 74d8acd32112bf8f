"""A lookup draft is cut to what its match length makes worth verifying: the planner learns
acceptance per drafter and match length from the drafts it verified, trims by it, keeps it
in the saved state, and greedy output stays plain decoding's whatever is cut."""

from __future__ import annotations

import pytest
import torch

from planning import drive
from specdraft.core.sampling import SamplingParams
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext, NgramDrafter, SuffixDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.planner import RoundPlanner
from specdraft.learning.policies import build_policy
from specdraft.models.cached_lm import CachedLM
from tiny import VOCAB, plain_greedy, tiny_llama


def taught(match_rates: dict[int, float], rounds: int = 60, **options):
    """A driver over one lookup drafter "d" whose drafts from a match of length m were
    accepted at each position with chance match_rates[m], with a verify that costs 40% of
    a step per extra row."""
    driver = drive("fixed", {"draft_length": "goodput"} | options, ["d"], draft_tokens=6)
    for n in range(rounds):
        for match, rate in match_rates.items():
            accepted = 6 if (n * rate) % 1 + rate >= 1 else 0  # a share `rate` of rounds all accepted
            alphas = [1.0] * 6 if accepted else [0.0] * 6
            driver.learn(RoundFeedback(0, 6, accepted, alphas, 0.1, draft_seconds=0.0006,
                                       verify_seconds=0.01 * (1 + 0.4 * 6), match_length=match))
            driver.learn(RoundFeedback(0, 1, 0, [0.0], 0.1, draft_seconds=0.0001, verify_seconds=0.014))
    return driver.planner


def test_a_short_match_that_rarely_holds_is_trimmed_and_a_long_one_is_not():
    planner = taught({1: 0.1, 5: 0.9})
    assert [planner.trimmed_length(0, 1, 6) for _ in range(20)].count(0) >= 18  # not worth a row
    assert [planner.trimmed_length(0, 5, 6) for _ in range(20)].count(6) >= 18  # every token pays
    assert planner.by_match.row(0, 12) == planner.by_match.row(0, 8) != planner.by_match.row(0, 7)  # 8 and longer: one bucket
    assert planner.trimmed_length(0, 0, 6) == 6  # not a lookup: untouched


@pytest.mark.parametrize("options", [{"draft_length": "fixed"}, {"objective": "acceptance"}])
def test_no_trim_with_fixed_lengths_or_without_costs_or_the_speed_objective(options):
    planner = taught({1: 0.0}, **options)
    assert planner.trimmed_length(0, 1, 6) == 6
    fresh = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=6).planner
    assert fresh.trimmed_length(0, 1, 6) == 6  # costs unknown


def test_the_match_acceptance_is_saved_loaded_and_checked():
    planner = taught({1: 0.1, 5: 0.9})
    state = planner.state()
    assert set(state) == {"costs", "acceptance", "match_acceptance"}
    other = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=6).planner
    other.load_state(state)
    assert other.by_match.rates(0, 1, 6) == planner.by_match.rates(0, 1, 6)
    older = {key: value for key, value in state.items() if key != "match_acceptance"}
    other.load_state(older)  # a state saved before the field existed: learned afresh
    with pytest.raises(ValueError, match="state field match_acceptance.hits"):
        other.load_state(state | {"match_acceptance": {"hits": [[0.0] * 6], "seen": [[0.0] * 6]}})


@pytest.mark.parametrize("policy", ["fixed", "normalhedge", "ucb"])
def test_trimmed_drafts_keep_greedy_output_and_teach_by_match_length(monkeypatch, policy):
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), SuffixDrafter("suffix", ctx, SuffixOptions())]
    cuts = []

    def trimmed_length(self, arm, match_length, drafted):  # cut at random, and record it
        keep = int(torch.randint(0, drafted + 1, ()))
        cuts.append((match_length, drafted, keep))
        return keep

    monkeypatch.setattr(RoundPlanner, "trimmed_length", trimmed_length)
    options = {"drafter": "lookup"} if policy == "fixed" else {}
    names = [d.name for d in drafters]
    engine = SpeculativeEngine(CachedLM(target), drafters,
                               build_policy(policy, options, names, seed=0, draft_tokens=5, horizon=40),
                               EngineSettings(5, 40, SamplingParams()))
    torch.manual_seed(0)
    prompt = [5, 9, 11, 3, 7, 5, 9, 11, 3, 7, 5]
    records = list(engine.generate(prompt))
    assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 40)
    assert cuts and any(keep < drafted for _, drafted, keep in cuts)
    assert sorted(r.drafted for r in records if r.drafted) == sorted(keep for _, _, keep in cuts if keep)
    learned = engine.driver.planner.by_match
    assert any(seen > 0 for row in learned.table.seen for seen in row)  # the kept drafts taught it
