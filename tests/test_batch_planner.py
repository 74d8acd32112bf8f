"""The batch planner of a serving engine's steps, without an engine: the step's prices,
the draft lengths it sends, the choice among a request's offers, and the calibration that
prices each offered token."""

from __future__ import annotations

import pytest

from specdraft.learning.batch_planner import (AGREED, ALL_ACCEPTED, ALONE, DISAGREED, FIRST_REJECTED, NO_DRAFT_YET,
                                              PART_ACCEPTED, MatchCalibration, StepCosts, draft_outcome, plan_batch,
                                              plan_offers, support, survival)


def costs_with(fixed: float, per_request: float, per_draft: float) -> StepCosts:
    costs = StepCosts()
    for requests in (1, 3, 8, 20):
        for drafted in (0, 4, 9, 30):
            for _ in range(3):
                costs.observe(requests, drafted, fixed + per_request * requests + per_draft * drafted)
    return costs


def test_the_batch_plan_probes_first_drafts_everything_on_a_flat_step_and_only_sure_tokens_on_a_priced_one():
    chances = [survival([0.9, 0.9, 0.9]), survival([0.3, 0.5]), []]
    assert plan_batch(chances, StepCosts()) == [1, 1, 0]  # the step's cost unknown: one token each
    assert plan_batch(chances, costs_with(0.05, 0.001, 0.0)) == [3, 2, 0]  # draft tokens free: all of them
    # A draft token priced as a request (nothing fixed): only one surer than the batch's rate pays.
    assert plan_batch(chances, costs_with(0.0, 0.01, 0.01)) == [0, 0, 0]
    # Mostly fixed: the sure request drafts all, the doubtful one stops where its chance drops.
    fixed, per_request, per_draft = 0.05, 0.001, 0.002
    plan = plan_batch(chances, costs_with(fixed, per_request, per_draft))
    assert plan[0] == 3 and plan[2] == 0
    seconds = fixed + per_request * 3 + per_draft * sum(plan)
    expected = 3 + sum(sum(c[:k]) for c, k in zip(chances, plan))
    for c, k in zip(chances, plan):  # no further token would raise the batch's rate
        if k < len(c):
            assert (expected + c[k]) / (seconds + per_draft) <= expected / seconds + 1e-12


def test_step_costs_tell_a_request_from_a_draft_token():
    fixed, per_request, per_draft = costs_with(0.03, 0.004, 0.001).prices()
    assert fixed == pytest.approx(0.03, rel=0.05) and per_request == pytest.approx(0.004, rel=0.05)
    assert per_draft == pytest.approx(0.001, rel=0.1)
    assert StepCosts().prices() is None


def test_a_request_sends_the_offer_with_the_most_sure_tokens_at_the_batch_price():
    long_fair, short_sure = survival([0.9] * 6), survival([0.99] * 3)
    # Before the price is known: the policy's offer (first), probed.
    assert plan_offers([[long_fair, short_sure]], StepCosts()) == [(0, 1)]
    # Free draft tokens: the offer that commits the most, whole.
    assert plan_offers([[short_sure, long_fair]], costs_with(0.05, 0.001, 0.0)) == [(1, 6)]
    # Priced tokens (32 requests, a draft token about half a request's share of the step): the sure ones.
    priced = costs_with(0.07, 0.004, 0.003)
    plan = plan_offers([[long_fair, short_sure]] + [[survival([0.9])]] * 31, priced)
    assert plan[0] == (1, 3) and all(choice == 0 for choice, _ in plan[1:])
    # A lone offer, or offers of equal worth: the policy's.
    assert plan_offers([[short_sure], [short_sure, list(short_sure)], []], priced)[:2] == [(0, 3), (0, 3)]
    assert plan_offers([[]], priced) == [(0, 0)]


def test_the_calibration_learns_streaks_and_agreement_and_prices_each_position():
    assert [draft_outcome(s, a) for s, a in ((0, 0), (3, 3), (3, 1), (3, 0))] == \
        [NO_DRAFT_YET, ALL_ACCEPTED, PART_ACCEPTED, FIRST_REJECTED]
    assert [support(5, []), support(5, [7, 5]), support(5, [7])] == [ALONE, AGREED, DISAGREED]
    calibration = MatchCalibration(arms=2, k_max=4)
    assert calibration.chances(0, 3, ALL_ACCEPTED, ALONE, 2) == survival([0.5, 0.5])  # nothing learned yet
    for _ in range(300):  # the same drafter and match length: after a full accept, after a miss
        calibration.observe(0, 3, ALL_ACCEPTED, AGREED, [1.0, 1.0, 1.0, 1.0])
        calibration.observe(0, 3, FIRST_REJECTED, DISAGREED, [0.0])
        calibration.observe(0, 3, NO_DRAFT_YET, ALONE, [1.0, 1.0, 0.0])  # third token wrong
    streak = calibration.chances(0, 3, ALL_ACCEPTED, AGREED, 4)
    missed = calibration.chances(0, 3, FIRST_REJECTED, DISAGREED, 4)
    assert min(streak) > 0.8 and max(missed) < 0.2
    first = calibration.rates(0, 3, NO_DRAFT_YET, ALONE, 3)
    assert first[0] > first[2] + 0.2  # the third position is priced apart from the first
    assert all(a >= b for a, b in zip(streak, streak[1:]))  # survival never rises


def test_the_calibration_state_round_trips_and_refuses_another_shape():
    calibration = MatchCalibration(arms=2, k_max=4)
    calibration.observe(1, 9, ALL_ACCEPTED, ALONE, [1.0, 0.0])
    restored = MatchCalibration(arms=2, k_max=4)
    restored.load(calibration.state())
    assert restored.chances(1, 9, ALL_ACCEPTED, ALONE, 3) == calibration.chances(1, 9, ALL_ACCEPTED, ALONE, 3)
    with pytest.raises(ValueError, match="another pool"):
        MatchCalibration(arms=3, k_max=4).load(calibration.state())
    for bad in ([1, 2], {"weights": calibration.state()["weights"]},
                {**calibration.state(), "squares": [0.0] * calibration.size}):
        with pytest.raises(ValueError, match="serving_calibration"):
            MatchCalibration(arms=2, k_max=4).load(bad)
