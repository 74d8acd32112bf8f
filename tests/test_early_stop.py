"""The early stop: the confidence calibration and the stop rule against brute force over
known costs and acceptance, and a model drafter stopping (or drafting on) inside real rounds."""

from __future__ import annotations

import pytest

from planning import drive, tiny_engine
from specdraft.learning.confidence import ConfidenceCalibration, StopRule
from specdraft.learning.goodput import AcceptanceByPosition


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


def test_the_stop_rule_drafts_on_while_the_rounds_rate_still_rises():
    """Costs measured on the Qwen pair on a 2-core CPU: a plain step 336 ms, each verified
    token 107 ms more, a draft token 42 ms. At 90% acceptance per token the rate still rises
    at the third token, so the rule drafts on past the first although the planned-rate bar
    (`price`, ~0.9 tokens) is above the next token's worth."""
    rule = line_rule(0.336, 0.149, price=0.92)
    assert rule.worth(1, 1.9, 0.81) and rule.worth(2, 2.71, 0.73)
    assert not rule.worth(1, 1.9, 0.3)


def test_a_fixed_confidence_floor_stops_drafting_and_stays_lossless():
    from tiny import plain_greedy

    target, drafter, engine = tiny_engine({"stop_below": 0.99}, draft_length="fixed")
    records = list(engine.generate([5, 9, 11, 3]))
    # a random tiny model is never 99% sure: each round drafts the plan's first token only
    assert all(r.drafted == min(1, r.learning.planned) for r in records) and records[0].learning.planned == 4
    assert [t for r in records for t in r.tokens] == plain_greedy(target, [5, 9, 11, 3], 30)


@pytest.mark.parametrize("per_token, expect_short", [(0.0, False), (0.9, True)])
def test_the_learned_stop_drafts_while_a_token_is_worth_its_time(per_token, expect_short):
    _, drafter, _ = tiny_engine()
    drafter.reset()
    draft = drafter.propose([5, 9, 11, 3], 4, stop=line_rule(0.1, per_token))
    assert (draft.tokens.shape[0] < 4) == expect_short
    drafter.on_commit(0)
    assert sum(drafter.calibration.seen) == min(1, draft.tokens.shape[0])  # the first token was rejected


def test_a_sure_draft_runs_past_the_plans_k_up_to_the_rules_horizon():
    _, drafter, _ = tiny_engine()
    drafter.reset()
    # Every token is worth its (free) time: the draft runs to the rule's horizon, not to k.
    assert drafter.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=7)).tokens.shape[0] == 7
    drafter.on_commit(0)
    assert drafter.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=2)).tokens.shape[0] == 2
    drafter.on_commit(0)
    _, floored, _ = tiny_engine({"stop_below": 0.0})  # a fixed floor keeps the plan's k
    floored.reset()
    assert floored.propose([5, 9, 11, 3], 2, stop=line_rule(0.1, 0.0, k=7)).tokens.shape[0] == 2


def test_the_plans_stop_rule_looks_ahead_to_the_round_cap():
    """The plan picks K on average acceptance; its stop rule reaches to the cap, with the
    same draw of rates, so a drafter's sure tokens can carry a round past K."""
    k_max = 8
    planner = drive("fixed", {"draft_length": "goodput"}, ["d"], draft_tokens=k_max).planner
    planner.acceptance = AcceptanceByPosition(1, k_max, prior_weight=1e-9)
    for m in range(k_max):
        planner.acceptance.hits[0][m], planner.acceptance.seen[0][m] = 0.7 * 1e6, 1e6
    for width in range(1, k_max + 2):  # an expensive verify per token: short drafts pay
        planner.costs.observe(0, width - 1, 0.01 * (width - 1), 0.05 + 0.05 * width)
    plan = planner.plan(0, 6)
    assert 1 <= plan.draft_tokens < 6
    assert plan.stop.horizon == 6 and len(plan.stop.rates) == 6
    assert plan.stop.seconds[:2] == pytest.approx([planner.costs.round_seconds(0, j) for j in range(2)])


def test_a_token_withheld_by_the_stop_is_judged_by_what_the_target_committed():
    """Calibration must also learn at the confidences where the drafter stops: the withheld
    token is checked against the target's token at its position once that is committed."""
    import torch

    _, drafter, _ = tiny_engine()
    drafter.reset()
    half = drafter.calibration  # every confidence: accepted half of the time
    half.hits, half.seen = [500.0] * half.bins, [1000.0] * half.bins
    context = [5, 9, 11, 3]
    # A second token that would pay if sure (1.5 + 0.5 tokens in 1.35 s beats 1.5 in 1.1 s)
    # but not at its calibrated chance: the drafter steps to judge it, then withholds it.
    rule = StopRule([1.0, 1.1, 1.35], [0.0, 0.0], price=0.0)
    draft = drafter.propose(context, 4, stop=rule)  # stops after one token
    assert draft.tokens.shape[0] == 1
    # The token the stop withheld (greedy: the drafter's argmax after its drafted token) and
    # the drafter's confidence in it, from its own model.
    with torch.no_grad():
        logits = drafter.causal_lm(torch.tensor([context + [int(draft.tokens[0])]])).logits[0, -1]
    withheld, confidence = int(logits.argmax()), float(torch.softmax(logits.float(), dim=-1).max())
    drafter.on_commit(1)  # the drafted token was accepted; the target's next token follows it
    before = list(drafter.calibration.hits), sum(drafter.calibration.seen)
    drafter.propose(context + [int(draft.tokens[0]), withheld], 1)
    b = drafter.calibration.bin_of(confidence)
    assert sum(drafter.calibration.seen) == before[1] + 1
    assert drafter.calibration.hits[b] == before[0][b] + 1  # the target agreed with it
    drafter.reset()
    drafter.propose(context, 4, stop=rule)
    drafter.on_commit(0)  # rejected before the withheld token: nothing to judge
    seen = sum(drafter.calibration.seen)
    drafter.propose(context + [7], 1)
    assert sum(drafter.calibration.seen) == seen


@pytest.mark.parametrize("per_token", [10.0, 0.9, 0.3, 0.05, 0.0])
def test_the_stop_never_runs_a_forward_for_a_token_that_could_not_pay(per_token):
    """A draft step computes the next token's distribution so the stop can judge it. Where
    not even a sure token would be worth its time the step is skipped: every forward after
    the first feeds a token that was then drafted, or the one the stop withheld."""
    _, drafter, _ = tiny_engine()
    steps = []
    inner = drafter._step
    drafter._step = lambda token: steps.append(int(token)) or inner(token)
    for context in ([5, 9, 11, 3], [7, 7, 2]):
        drafter.reset()
        steps.clear()
        draft = drafter.propose(context, 4, stop=line_rule(0.1, per_token))
        drafted = draft.tokens.shape[0]
        withheld = drafter._withheld is not None
        assert len(steps) == drafted - 1 + withheld
        if per_token == 10.0:  # a second token cannot pay at any confidence: no step at all
            assert drafted == 1 and steps == [] and not withheld
        drafter.on_commit(0)
