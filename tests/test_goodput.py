"""The round cost model, acceptance by position and the goodput-optimal draft length,
against brute force on known acceptance curves and known timings."""

from __future__ import annotations

import random

import pytest

from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.goodput import AcceptanceByPosition, RoundCostModel, best_draft_length
from specdraft.learning.policies import build_policy


def test_cost_model_recovers_a_linear_verify_cost_and_per_token_draft_cost():
    costs = RoundCostModel(arms=2)
    assert costs.round_seconds(0, 0) is None
    for width in [1, 3, 6, 2, 5, 4] * 5:
        costs.observe(0, width - 1, 0.003 * (width - 1), 0.02 + 0.005 * width)
    for k in range(6):
        # within a few percent: the ridge shrinks the slope a little even on clean data
        assert costs.round_seconds(0, k) == pytest.approx(0.02 + 0.005 * (k + 1) + 0.003 * k, rel=0.03)
    assert costs.round_seconds(1, 2) is None  # arm 1 never drafted: its cost is unknown
    assert costs.round_seconds(1, 0) == pytest.approx(0.025, rel=0.03)  # plain decoding needs no drafter


def test_a_few_noisy_wide_rounds_do_not_fix_a_steep_verify_slope():
    costs = RoundCostModel(arms=1)
    for t in range(40):
        costs.observe(0, 1 if t in (5, 30) else 0, 0.0, 0.040 if t in (5, 30) else 0.020)
    raw_slope = 0.020  # what least squares alone would say: each extra token doubles the verify
    assert costs.round_seconds(0, 1) - costs.round_seconds(0, 0) < raw_slope / 2


def test_a_single_verify_width_gives_a_flat_cost_not_a_guess():
    costs = RoundCostModel(arms=1)
    for _ in range(5):
        costs.observe(0, 4, 0.0, 0.03)
    assert costs.round_seconds(0, 1) == pytest.approx(0.03)


def test_acceptance_by_position_learns_conditional_rates():
    acc = AcceptanceByPosition(arms=1, k_max=3, prior_weight=1e-6, decay=1.0)
    rng = random.Random(0)
    rates = [0.9, 0.6, 0.3]
    for _ in range(4000):
        alignment = []
        for rate in rates:
            hit = 1.0 if rng.random() < rate else 0.0
            alignment.append(hit)
            if not hit:
                alignment += [1.0, 1.0]  # positions after a rejection must not count
                break
        acc.observe(0, alignment)
    for m, rate in enumerate(rates, start=1):
        assert acc.rate(0, m) == pytest.approx(rate, abs=0.03)
    expected = 1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.3
    assert acc.expected_committed(0, 3) == pytest.approx(expected, abs=0.05)


@pytest.mark.parametrize("seed", range(20))
def test_chosen_draft_length_is_the_brute_force_best(seed):
    rng = random.Random(seed)
    k_max = 6
    rates = [rng.uniform(0.05, 0.98) for _ in range(k_max)]
    fixed, per_token, draft = rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.02)
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=k_max)
    policy.acceptance = AcceptanceByPosition(1, k_max, prior_weight=1e-9)
    for m, rate in enumerate(rates):
        policy.acceptance.hits[0][m], policy.acceptance.seen[0][m] = rate * 1e6, 1e6
    for width in range(1, k_max + 2):
        policy.costs.observe(0, width - 1, draft * (width - 1), fixed + per_token * width)

    def goodput(k):
        tokens, survive = 1.0, 1.0
        for m in range(k):
            survive *= rates[m]
            tokens += survive
        return tokens / (fixed + per_token * (k + 1) + draft * k)

    brute = max(range(k_max + 1), key=goodput)
    chosen = policy.draft_length(0, k_max)
    assert goodput(chosen) == pytest.approx(goodput(brute), rel=1e-6)
    assert policy.draft_length(0, 2) == max(range(3), key=goodput)  # the cap is respected


def test_goodput_learns_from_rounds_and_drafts_less_when_drafts_fail():
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=5)
    assert policy.draft_length(0, 5) == 1  # draft cost unknown: one token measures it
    for _ in range(50):  # every draft rejected at once; wide verifies cost more
        policy.update(RoundFeedback(0, 5, 0, [0.0] * 5, 0.1, draft_seconds=0.05, verify_seconds=0.06))
        policy.update(RoundFeedback(0, 1, 0, [0.0], 0.1, draft_seconds=0.01, verify_seconds=0.04))
    assert policy.draft_length(0, 5) == 0


def test_ties_pick_the_shortest_draft():
    assert best_draft_length([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0


# --- early stop and the cost model against the round's own timings ---------------------

from specdraft.learning.confidence import ConfidenceCalibration, StopRule  # noqa: E402


def test_calibration_learns_that_a_confident_drafter_is_wrong():
    calibration = ConfidenceCalibration()
    assert calibration.acceptance(0.95) == pytest.approx(0.95)  # nothing seen: trust the drafter
    for _ in range(50):  # confident tokens rejected at once, every time
        calibration.observe([0.95, 0.9, 0.97], accepted=0)
    assert calibration.acceptance(0.95) < 0.1
    assert calibration.seen[9] == 50 and calibration.seen[8] == 0  # unreached tokens say nothing


def line_rule(base, per_token, k=8, rates=None, price=0.0):
    """A stop rule over linear round costs: T_j = base + j * per_token."""
    return StopRule([base + j * per_token for j in range(k + 1)], rates or [0.0] * k, price)


# Round seconds by drafted tokens j on the Qwen pair's CPU, stepped: the verify's forward
# over j + 1 tokens padded to the cheapest wider width, plus 42 ms per draft token.
QWEN_STEPS = [0.349, 0.376, 0.456] + [0.739] * 3 + [0.929] * 14
QWEN_SECONDS = [v + 0.042 * j for j, v in enumerate(QWEN_STEPS)]


@pytest.mark.parametrize("seconds", [[0.336 + 0.149 * j for j in range(9)], [0.02 + 0.001 * j for j in range(9)],
                                     [0.05 + 0.04 * j for j in range(9)], QWEN_SECONDS[:9], QWEN_SECONDS])
@pytest.mark.parametrize("rates", [[0.95, 0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0.6] * 8, [0.99] * 8,
                                   [0.9, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [0.97] * 19])
def test_the_stop_rule_drafts_to_the_length_with_the_best_rate(seconds, rates):
    """When the draft's tokens survive as the rule projects, it stops exactly where E_j / T_j
    peaks (brute force over every length): through dips in acceptance and through steps in
    the verify cost that a one-token look would stop at."""
    k = min(len(seconds) - 1, len(rates))
    rule = StopRule(seconds[: k + 1], rates[:k], price=0.0)
    survive, expected, drafted = 1.0, 1.0, 1  # the plan's first token is always drafted
    survive *= rates[0]
    expected += survive
    while drafted < k and rule.worth(drafted, expected, survive * rates[drafted]):
        survive *= rates[drafted]
        expected += survive
        drafted += 1
    rate = []
    for j in range(1, k + 1):
        e, s = 1.0, 1.0
        for a in rates[:j]:
            s *= a
            e += s
        rate.append(e / seconds[j])
    assert rate[drafted - 1] == pytest.approx(max(rate))


def test_a_step_in_the_verify_cost_does_not_stop_a_draft_that_pays_past_it():
    """On the Qwen pair's CPU a forward over 4 tokens costs more than one over 3; a draft
    accepted 97% of the time still pays off at 19 tokens, so the rule drafts on at 3."""
    rule = StopRule(QWEN_SECONDS, [0.97] * 19, price=0.0)
    expected = 1 + 0.97 + 0.97**2
    assert rule.worth(2, expected, 0.97**3)
    myopic = StopRule(QWEN_SECONDS, [0.0] * 19, price=0.0)  # no lookahead: the next token alone
    assert not myopic.worth(2, expected, 0.97**3)


def test_the_stop_rule_no_longer_stops_a_draft_whose_tokens_are_all_accepted():
    """Costs measured on the Qwen pair on a 2-core CPU: a plain step 336 ms, each verified
    token 107 ms more, a draft token 42 ms. At 90% acceptance per token the rate still rises
    at the third token; the planned-rate bar (~0.9 tokens) stopped after the first."""
    rule = line_rule(0.336, 0.149, price=0.92)
    assert rule.worth(1, 1.9, 0.81) and rule.worth(2, 2.71, 0.73)
    assert not rule.worth(1, 1.9, 0.3)


def _tiny_engine(drafter_options=None, k=4, max_new=30, **policy_options):
    import torch

    from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
    from specdraft.decoding.sampling import SamplingParams
    from specdraft.drafters import DraftContext, ModelDrafter
    from specdraft.models.cached_lm import CachedLM
    from tiny import VOCAB, tiny_llama

    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafter = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1), **(drafter_options or {}))
    policy = build_policy("fixed", {"drafter": "small"} | policy_options, ["small"], draft_tokens=k, horizon=max_new)
    return target, drafter, SpeculativeEngine(CachedLM(target), [drafter], policy,
                                              EngineSettings(k, max_new, SamplingParams()))


def test_a_fixed_confidence_floor_stops_drafting_and_stays_lossless():
    from tiny import plain_greedy

    target, drafter, engine = _tiny_engine({"stop_below": 0.99}, draft_length="fixed")
    records = list(engine.generate([5, 9, 11, 3]))
    # a random tiny model is never 99% sure: each round drafts the plan's first token only
    assert all(r.drafted == min(1, r.planned) for r in records) and records[0].planned == 4
    assert [t for r in records for t in r.tokens] == plain_greedy(target, [5, 9, 11, 3], 30)


@pytest.mark.parametrize("per_token, expect_short", [(0.0, False), (0.9, True)])
def test_the_learned_stop_drafts_while_a_token_is_worth_its_time(per_token, expect_short):
    _, drafter, _ = _tiny_engine()
    drafter.reset()
    draft = drafter.propose([5, 9, 11, 3], 4, stop=line_rule(0.1, per_token))
    assert (draft.tokens.shape[0] < 4) == expect_short
    drafter.on_commit(0)
    assert sum(drafter.calibration.seen) == min(1, draft.tokens.shape[0])  # the first token was rejected


def test_a_sure_draft_runs_past_the_plans_k_up_to_the_rules_horizon():
    _, drafter, _ = _tiny_engine()
    drafter.reset()
    # Every token is worth its (free) time: the draft runs to the rule's horizon, not to k.
    assert drafter.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=7)).tokens.shape[0] == 7
    drafter.on_commit(0)
    assert drafter.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=2)).tokens.shape[0] == 2
    drafter.on_commit(0)
    _, floored, _ = _tiny_engine({"stop_below": 0.0})  # a fixed floor keeps the plan's k
    floored.reset()
    assert floored.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=7)).tokens.shape[0] == 2


def test_the_plans_stop_rule_looks_ahead_to_the_round_cap():
    """The plan picks K on average acceptance; its stop rule reaches to the cap, with the
    same draw of rates, so a drafter's sure tokens can carry a round past K."""
    k_max = 8
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=k_max)
    policy.acceptance = AcceptanceByPosition(1, k_max, prior_weight=1e-9)
    for m in range(k_max):
        policy.acceptance.hits[0][m], policy.acceptance.seen[0][m] = 0.7 * 1e6, 1e6
    for width in range(1, k_max + 2):  # an expensive verify per token: short drafts pay
        policy.costs.observe(0, width - 1, 0.01 * (width - 1), 0.05 + 0.05 * width)
    plan = policy.plan(6)
    assert 1 <= plan.draft_tokens < 6
    assert plan.stop.horizon == 6 and len(plan.stop.rates) == 6
    assert plan.stop.seconds[:2] == pytest.approx([policy.costs.round_seconds(0, j) for j in range(2)])


def test_the_cost_model_matches_the_rounds_timings(monkeypatch):
    """A fake clock makes a verify of n tokens cost 10 ms + 2 ms * n and a drafted token
    4 ms; the policy's estimate of T(arm, K) must then be exactly what rounds measure."""
    import time as time_module

    _, drafter, engine = _tiny_engine(draft_length="goodput")
    clock = [0.0]
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock[0])
    feed, propose = engine.target.feed_with_hidden, drafter.propose

    def timed_feed(tokens, keep, layers):
        clock[0] += 0.010 + 0.002 * tokens.shape[-1]
        return feed(tokens, keep, layers)

    def timed_propose(context, k, stop=None):
        draft = propose(context, k, stop)
        clock[0] += 0.004 * draft.tokens.shape[0]
        return draft

    monkeypatch.setattr(engine.target, "feed_with_hidden", timed_feed)
    monkeypatch.setattr(drafter, "propose", timed_propose)
    records = list(engine.generate([5, 9, 11, 3, 5, 9]))
    widths = {r.drafted for r in records}
    assert len(widths) >= 2  # the line was fitted on more than one width
    costs, seen, checked = engine.policy.costs, set(), 0
    for r in records:
        assert r.draft_s + r.verify_s == pytest.approx(0.010 + 0.002 * (r.drafted + 1) + 0.004 * r.drafted)
        # the ridge on the verify slope keeps estimates a little optimistic: within 10%
        assert costs.round_seconds(0, r.drafted) == pytest.approx(r.draft_s + r.verify_s, rel=0.1)
        if len(seen) >= 2 and r.drafted == r.planned:  # a line needs two widths
            assert r.expected_seconds == pytest.approx(r.draft_s + r.verify_s, rel=0.1)
            checked += 1
        seen.add(r.drafted)
    assert checked > 0


def test_a_drafter_planned_at_zero_is_reprobed_with_backoff():
    policy = build_policy("ucb", {}, ["slow"], draft_tokens=5)
    for width in (1, 2) * 10:  # drafting costs 10x a verify: never worth it
        policy.costs.observe(0, width - 1, 0.2 * (width - 1), 0.02)
    plans = [policy.draft_length(0, 5) for _ in range(8 + 16 + 32 + 3)]
    probes = [t for t, k in enumerate(plans) if k]
    assert probes == [7, 7 + 16, 7 + 16 + 32]  # the gap doubles after each idle probe
    assert set(plans) == {0, 1}


def test_catching_up_is_not_charged_as_drafting():
    _, drafter, _ = _tiny_engine()
    drafter.reset()
    context = [5, 9, 11, 3, 7, 5, 9, 11, 3, 7, 1, 2]
    first = drafter.propose(context, 2)  # twelve unseen tokens: mostly catch-up
    assert first.catch_up_seconds > 0
    drafter.on_commit(1)
    context = context + [int(first.tokens[0]), 4]  # one draft accepted, then the recovered token
    second = drafter.propose(context, 2)  # only the recovered token is new: no catch-up
    assert second.catch_up_seconds == 0.0


def test_an_untried_position_is_expected_to_do_as_well_as_the_one_before():
    """A drafter that was only ever drafted 3 deep and always accepted must be tried deeper:
    with a fixed 0.5 prior at unseen positions the draft length would never grow past 3."""
    acc = AcceptanceByPosition(arms=1, k_max=8)
    for _ in range(50):
        acc.observe(0, [1.0, 1.0, 1.0])
    assert acc.rate(0, 4) > 0.95 and acc.rate(0, 8) > 0.95
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=8)
    policy.acceptance = acc
    for width in range(1, 10):
        policy.costs.observe(0, width - 1, 0.0, 0.03 + 0.002 * width)
    assert policy.best_length(0, 8) == 8


def test_a_new_prompt_starts_from_the_earlier_prompts_acceptance_worth_a_few_rounds():
    """A pair that accepted nearly everything on earlier prompts must not start the next one
    from the flat 0.5 prior (which plans plain rounds until its own evidence outweighs it),
    and an earlier prompt must not outweigh more than a few of this prompt's rounds."""
    acc = AcceptanceByPosition(arms=2, k_max=4, decay=1.0)
    for _ in range(40):
        acc.observe(0, [1.0, 1.0, 1.0, 0.0])
    carried = acc.carried_over(4.0)
    assert carried.seen[0] == [4.0, 4.0, 4.0, 4.0] and carried.hits[0] == [4.0, 4.0, 4.0, 0.0]
    assert carried.seen[1] == [0.0] * 4  # an arm never drafted stays at the prior
    assert carried.rate(0, 1) == pytest.approx((4.0 + 0.5) / 5.0)
    policy = build_policy("ucb", {"draft_length": "goodput", "reset": "prompt"}, ["d", "e"], draft_tokens=4)
    for _ in range(40):
        policy.update(RoundFeedback(0, 4, 3, [1.0, 1.0, 1.0, 0.0], 0.1, draft_seconds=0.01, verify_seconds=0.05))
    policy.reset()  # the next prompt: the learner forgets, the acceptance is carried over
    assert policy.acceptance.seen[0][0] == pytest.approx(4.0) and policy.acceptance.rate(0, 1) > 0.85
    assert sum(policy.pulls) == 0 and policy.t == 0


def test_a_token_withheld_by_the_stop_is_judged_by_what_the_target_committed():
    """Calibration must also learn at the confidences where the drafter stops: the withheld
    token is checked against the target's token at its position once that is committed."""
    _, drafter, _ = _tiny_engine()
    drafter.reset()
    context = [5, 9, 11, 3]
    draft = drafter.propose(context, 4, stop=line_rule(0.1, 10.0))  # stops after one token
    assert draft.tokens.shape[0] == 1
    _, withheld, confidence = drafter._withheld
    drafter.on_commit(1)  # the drafted token was accepted; the target's next token follows it
    before = list(drafter.calibration.hits), sum(drafter.calibration.seen)
    drafter.propose(context + [int(draft.tokens[0]), withheld], 1)
    b = drafter.calibration._bin(confidence)
    assert sum(drafter.calibration.seen) == before[1] + 1
    assert drafter.calibration.hits[b] == before[0][b] + 1  # the target agreed with it
    drafter.reset()
    drafter.propose(context, 4, stop=line_rule(0.1, 10.0))
    drafter.on_commit(0)  # rejected before the withheld token: nothing to judge
    seen = sum(drafter.calibration.seen)
    drafter.propose(context + [7], 1)
    assert sum(drafter.calibration.seen) == seen


# --- the verify cost curve: measured by width, padded to a cheaper wider width ----------

from specdraft.learning.goodput import VerifyCosts  # noqa: E402

# Seconds of Qwen2.5-Coder-1.5B's forward (float32, 2-core CPU) over 1 .. 17 tokens.
QWEN_CURVE = [0.349, 0.376, 0.456, 0.809, 0.739, 0.784, 1.048, 0.970, 1.020, 1.262, 1.448, 1.364, 1.607,
              1.788, 1.974, 1.026, 1.089]


def test_a_verify_is_padded_to_the_cheapest_width_at_least_as_wide():
    costs = VerifyCosts(decay=0.95)
    costs.install(QWEN_CURVE)
    assert [costs.padded_width(w) for w in range(1, 18)] == [1, 2, 3, 5, 5, 6, 8, 8, 9, 16, 16, 16, 16, 16, 16,
                                                             16, 17]
    assert costs.padded_width(30) == 30  # past the curve: as asked
    planned = [costs(w) for w in range(1, 18)]
    assert planned[6] == pytest.approx(0.970) and planned[14] == pytest.approx(1.026)
    # what a plan sees never falls by more than the margin as the width grows
    assert all(b >= a * VerifyCosts.MARGIN for a, b in zip(planned, planned[1:]))


def test_the_curve_is_rescaled_to_this_runs_timings():
    costs = VerifyCosts(decay=0.9)
    costs.install(QWEN_CURVE)
    for _ in range(100):  # this run's machine is twice as slow as the measurement
        costs.add(16, 2 * 1.026)
        costs.add(1, 2 * 0.349)
    assert costs(1) == pytest.approx(0.698, rel=0.01) and costs(9) == pytest.approx(2.052, rel=0.01)


def test_the_plan_drafts_past_a_cost_step_when_a_wider_round_is_faster():
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=16)
    policy.costs.verify.install(QWEN_CURVE)
    policy.costs.observe(0, 1, 0.042, 0.376, verify_width=2)
    for _ in range(50):
        policy.acceptance.observe(0, [1.0] * 16)
    # 15 tokens verified by the 16-wide forward: 1.66 s for 16 tokens against 0.35 s for one
    assert policy.best_length(0, 16) in (15, 16)
    assert policy.best_length(0, 6) == 5  # capped below the step: 6 wide (0.78 s), not 7 (1.05 s)


def test_width_costs_are_measured_once_and_kept(tmp_path, monkeypatch):
    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM
    from tiny import tiny_llama

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    lm = CachedLM(tiny_llama(seed=0))
    assert not width_costs.known(lm, 5)
    first = width_costs.width_costs(lm, 5)
    assert len(first) == 5 and all(s > 0 for s in first) and lm.length == 0
    assert width_costs.known(lm, 5) and not width_costs.known(lm, 6)
    monkeypatch.setattr(width_costs, "measure_width_costs", lambda *a, **k: pytest.fail("measured twice"))
    assert width_costs.width_costs(CachedLM(tiny_llama(seed=7)), 5) == first  # same shape, other weights
    (file,) = (tmp_path / "width-costs").iterdir()
    file.write_text("not json")
    monkeypatch.undo()
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    assert len(width_costs.width_costs(lm, 5)) == 5  # an unreadable entry is measured again


def test_one_rejection_deep_in_a_draft_does_not_keep_plans_short_for_good():
    """A position is measured only when a round drafts that deep: planned on posterior
    means, one early miss at position 5 holds every later plan short of it (so it is never
    corrected); planned on posterior draws, deeper drafts are tried again."""
    policy = build_policy("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=16, seed=0)
    policy.costs.verify.install(QWEN_CURVE)
    policy.costs.observe(0, 1, 0.042, 0.376, verify_width=2)
    policy.acceptance.observe(0, [1.0] * 4 + [0.0])
    for _ in range(30):
        policy.acceptance.observe(0, [1.0, 1.0])
    assert policy.best_length(0, 16) < 5
    assert max(policy.draft_length(0, 16) for _ in range(50)) > 5


def test_a_long_width_measurement_is_announced_first(monkeypatch):
    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM
    from tiny import tiny_llama

    lm, said = CachedLM(tiny_llama(seed=0)), []
    width_costs.measure_width_costs(lm, 4, repeats=1, announce=said.append)
    assert said == []  # a tiny model measures in milliseconds: nothing to say
    monkeypatch.setattr(width_costs, "ANNOUNCE_S", 0.0)
    width_costs.measure_width_costs(lm, 4, repeats=1, announce=said.append)
    assert len(said) == 1 and said[0] > 0
