"""The round cost model, acceptance by position and the goodput-optimal draft length,
against brute force on known acceptance curves and known timings."""

from __future__ import annotations

import random

import pytest

from planning import drive, tiny_engine
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.goodput import AcceptanceByPosition, RoundCostModel, VerifyCosts, best_draft_length


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
        assert acc.rates(0, m)[m - 1] == pytest.approx(rate, abs=0.03)
    expected = 1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.3
    assert acc.expected_committed(0, 3) == pytest.approx(expected, abs=0.05)


@pytest.mark.parametrize("seed", range(20))
def test_chosen_draft_length_is_the_brute_force_best(seed):
    rng = random.Random(seed)
    k_max = 6
    rates = [rng.uniform(0.05, 0.98) for _ in range(k_max)]
    fixed, per_token, draft = rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.02)
    planner = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=k_max).planner
    planner.acceptance = AcceptanceByPosition(1, k_max, prior_weight=1e-9)
    for m, rate in enumerate(rates):
        planner.acceptance.hits[0][m], planner.acceptance.seen[0][m] = rate * 1e6, 1e6
    for width in range(1, k_max + 2):
        planner.costs.observe(0, width - 1, draft * (width - 1), fixed + per_token * width)

    def goodput(k):
        tokens, survive = 1.0, 1.0
        for m in range(k):
            survive *= rates[m]
            tokens += survive
        return tokens / (fixed + per_token * (k + 1) + draft * k)

    brute = max(range(k_max + 1), key=goodput)
    chosen = planner.draft_length(0, k_max)
    assert goodput(chosen) == pytest.approx(goodput(brute), rel=1e-6)
    assert planner.draft_length(0, 2) == max(range(3), key=goodput)  # the cap is respected


def test_goodput_learns_from_rounds_and_drafts_less_when_drafts_fail():
    driver = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=5)
    assert driver.planner.draft_length(0, 5) == 1  # draft cost unknown: one token measures it
    for _ in range(50):  # every draft rejected at once; wide verifies cost more
        driver.learn(RoundFeedback(0, 5, 0, [0.0] * 5, 0.1, draft_seconds=0.05, verify_seconds=0.06))
        driver.learn(RoundFeedback(0, 1, 0, [0.0], 0.1, draft_seconds=0.01, verify_seconds=0.04))
    assert driver.planner.draft_length(0, 5) == 0


def test_ties_pick_the_shortest_draft():
    assert best_draft_length([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0


# --- the cost model against the round's own timings, and K across rounds and prompts ----


def test_the_cost_model_matches_the_rounds_timings(monkeypatch):
    """A fake clock makes a verify of n tokens cost 10 ms + 2 ms * n and a drafted token
    4 ms; the planner's estimate of T(arm, K) must then be exactly what rounds measure."""
    import time as time_module

    _, drafter, engine = tiny_engine(draft_length="goodput")
    clock = [0.0]
    monkeypatch.setattr(time_module, "perf_counter", lambda: clock[0])
    feed, propose = engine.target.feed_with_hidden, drafter.propose

    def timed_feed(tokens, keep, layers):
        clock[0] += 0.010 + 0.002 * tokens.shape[-1]
        return feed(tokens, keep, layers)

    def timed_propose(context, k, stop=None, runner_up=False):
        draft = propose(context, k, stop, runner_up)
        clock[0] += 0.004 * draft.tokens.shape[0]
        return draft

    monkeypatch.setattr(engine.target, "feed_with_hidden", timed_feed)
    monkeypatch.setattr(drafter, "propose", timed_propose)
    records = list(engine.generate([5, 9, 11, 3, 5, 9]))
    widths = {r.drafted for r in records}
    assert len(widths) >= 2  # the line was fitted on more than one width
    costs, seen, checked = engine.driver.planner.costs, set(), 0
    for r in records:
        assert r.times.draft_s + r.times.verify_s == pytest.approx(0.010 + 0.002 * (r.drafted + 1) + 0.004 * r.drafted)
        # the ridge on the verify slope keeps estimates a little optimistic: within 10%
        assert costs.round_seconds(0, r.drafted) == pytest.approx(r.times.draft_s + r.times.verify_s, rel=0.1)
        if len(seen) >= 2 and r.drafted == r.learning.planned:  # a line needs two widths
            assert r.learning.expected_seconds == pytest.approx(r.times.draft_s + r.times.verify_s, rel=0.1)
            checked += 1
        seen.add(r.drafted)
    assert checked > 0


def test_a_drafter_planned_at_zero_is_reprobed_with_backoff():
    planner = drive("ucb", {}, ["slow"], draft_tokens=5).planner
    for width in (1, 2) * 10:  # drafting costs 10x a verify: never worth it
        planner.costs.observe(0, width - 1, 0.2 * (width - 1), 0.02)
    plans = [planner.draft_length(0, 5) for _ in range(8 + 16 + 32 + 3)]
    probes = [t for t, k in enumerate(plans) if k]
    assert probes == [7, 7 + 16, 7 + 16 + 32]  # the gap doubles after each idle probe
    assert set(plans) == {0, 1}


def test_catching_up_is_not_charged_as_drafting():
    """The draft's first forward over unseen committed tokens is split into a one-token
    step and catch-up; what the split is measured on is asserted, not timed here (a
    loaded machine may run a 12-token forward faster than a one-token step)."""
    _, drafter, _ = tiny_engine()
    drafter.reset()
    split = []
    measure = drafter._catch_up
    drafter._catch_up = lambda unseen, first, rest, steps: split.append(unseen) or measure(unseen, first, rest, steps)
    context = [5, 9, 11, 3, 7, 5, 9, 11, 3, 7, 1, 2]
    first = drafter.propose(context, 2)  # twelve unseen tokens: mostly catch-up
    drafter.on_commit(1)
    context = context + [int(first.tokens[0]), 4]  # one draft accepted, then the recovered token
    second = drafter.propose(context, 2)  # only the recovered token is new: no catch-up
    assert split == [12, 1] and second.catch_up_seconds == 0.0
    drafter._step_seconds = None  # no step measured yet: the forward's share beyond one token
    assert measure(12, 0.012, 0.0, 0) == pytest.approx(0.011)
    assert measure(12, 0.012, 0.002, 2) == pytest.approx(0.011)  # a measured step: the rest
    assert measure(12, 0.0005, 0.002, 2) == 0.0  # never negative


def test_an_untried_position_is_expected_to_do_as_well_as_the_one_before():
    """A drafter that was only ever drafted 3 deep and always accepted must be tried deeper:
    with a fixed 0.5 prior at unseen positions the draft length would never grow past 3."""
    acc = AcceptanceByPosition(arms=1, k_max=8)
    for _ in range(50):
        acc.observe(0, [1.0, 1.0, 1.0])
    assert acc.rates(0, 4)[3] > 0.95 and acc.rates(0, 8)[7] > 0.95
    planner = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=8).planner
    planner.acceptance = acc
    for width in range(1, 10):
        planner.costs.observe(0, width - 1, 0.0, 0.03 + 0.002 * width)
    assert planner.best_length(0, 8) == 8


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
    assert carried.rates(0, 1)[0] == pytest.approx((4.0 + 0.5) / 5.0)
    driver = drive("ucb", {"draft_length": "goodput", "reset": "prompt"}, ["d", "e"], draft_tokens=4)
    for _ in range(40):
        driver.learn(RoundFeedback(0, 4, 3, [1.0, 1.0, 1.0, 0.0], 0.1, draft_seconds=0.01, verify_seconds=0.05))
    driver.start_prompt()  # the next prompt: the learner forgets, the acceptance is carried over
    acceptance, policy = driver.planner.acceptance, driver.policy
    assert acceptance.seen[0][0] == pytest.approx(4.0) and acceptance.rates(0, 1)[0] > 0.85
    assert sum(policy.pulls) == 0 and policy.t == 0


# --- the verify cost curve: measured by width, padded to a cheaper wider width ----------

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
    planner = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=16).planner
    planner.costs.verify.install(QWEN_CURVE)
    planner.costs.observe(0, 1, 0.042, 0.376, verify_width=2)
    for _ in range(50):
        planner.acceptance.observe(0, [1.0] * 16)
    # 15 tokens verified by the 16-wide forward: 1.66 s for 16 tokens against 0.35 s for one
    assert planner.best_length(0, 16) in (15, 16)
    assert planner.best_length(0, 6) == 5  # capped below the step: 6 wide (0.78 s), not 7 (1.05 s)


def test_width_costs_are_measured_once_and_kept(tmp_path, monkeypatch):
    from specdraft.models import width_costs
    from specdraft.models.cached_lm import CachedLM
    from tiny import tiny_llama

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    # what is kept and found again, not the timings: a busy machine must not make the curve
    # unsteady (not kept) or the stored step disagree with a quick timing (measured again)
    monkeypatch.setattr(width_costs, "_steady", lambda samples: True)
    lm = CachedLM(tiny_llama(seed=0))
    assert not width_costs.known(lm, 5)
    first = width_costs.width_costs(lm, 5)
    monkeypatch.setattr(width_costs, "_quick_step", lambda lm: first[0])
    assert len(first) == 5 and all(s > 0 for s in first) and lm.length == 0
    assert width_costs.known(lm, 5) and not width_costs.known(lm, 6)
    timed = width_costs.timed_widths  # (a stored curve's check times one width; the curve is all of them)
    monkeypatch.setattr(width_costs, "timed_widths",
                        lambda lm, n, *a, **k: pytest.fail("measured twice") if n > 1 else timed(lm, n, *a, **k))
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
    planner = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=16, seed=0).planner
    planner.costs.verify.install(QWEN_CURVE)
    planner.costs.observe(0, 1, 0.042, 0.376, verify_width=2)
    planner.acceptance.observe(0, [1.0] * 4 + [0.0])
    for _ in range(30):
        planner.acceptance.observe(0, [1.0, 1.0])
    assert planner.best_length(0, 16) < 5
    assert max(planner.draft_length(0, 16) for _ in range(50)) > 5


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


def test_a_prompts_catch_up_is_split_off_at_what_a_one_token_step_costs():
    """A fake clock makes a drafter's forward over n tokens take 10 ms + 1 ms per token, so a
    draft of 3 tokens after a 50-token prompt spends 60 ms in its first forward, of which 49
    ms are catch-up: what is left is 11 ms a drafted token, the cost of a step. A pro-rata
    split (49/50 of the first forward) would leave the drafter looking 30% cheaper."""
    _, drafter, _ = tiny_engine()
    drafter.reset()
    clock, real_feed = [0.0], drafter.lm.feed

    def timed_feed(tokens, *args, **kwargs):
        clock[0] += 0.010 + 0.001 * tokens.shape[-1]
        return real_feed(tokens, *args, **kwargs)

    drafter.lm.clock = lambda: clock[0]
    drafter.lm.feed = timed_feed
    context = [(7 * i) % 20 + 3 for i in range(50)]
    draft = drafter.propose(context, 3)
    assert draft.tokens.shape[0] == 3
    charged = (clock[0] - draft.catch_up_seconds) / 3
    assert charged == pytest.approx(0.011, rel=0.01)


def test_a_drafters_cost_is_a_mean_over_rounds_not_anchored_on_the_first():
    """The first round of a prompt often includes a catch-up the draft cannot fully split
    off; it must weigh as one round among the rest, not as a moving average's start."""
    costs = RoundCostModel(2)
    costs.observe(1, 1, 0.001, 0.05)  # the odd first round
    for _ in range(10):
        costs.observe(1, 4, 4 * 0.030, 0.08)
    assert costs.draft[1] == pytest.approx(0.030, rel=0.08)
    costs.load(costs.state())  # a loaded cost counts as a few rounds of evidence
    costs.observe(1, 1, 0.060, 0.05)
    assert 0.030 < costs.draft[1] < 0.045


def test_a_rows_seconds_by_length_are_the_round_costs_at_every_length():
    """`seconds_by_length` is what the estimates price a whole row of draft lengths with: it
    must be `round_seconds` at every k, None where that is (no verify timed; an arm that
    never drafted, past k = 0), on the fitted line and on a measured curve with padding."""
    costs = RoundCostModel(2)
    assert costs.seconds_by_length(0, 4) == [None] * 5
    costs.observe(0, 3, 0.003, 0.012)
    costs.observe(0, 0, 0.0, 0.008)
    for curve in (None, [0.008, 0.009, 0.0085, 0.012, 0.011, 0.02]):
        if curve:
            costs.verify.install(curve)
        for arm in (0, 1):
            assert costs.seconds_by_length(arm, 7) == [costs.round_seconds(arm, k) for k in range(8)]
    assert costs.seconds_by_length(1, 3)[0] is not None and costs.seconds_by_length(1, 3)[1:] == [None] * 3
