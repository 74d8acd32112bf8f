"""Policies are plain Python, tested by simulation against arms with known acceptance."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from policy_sim import Arms, K, drive, make, share, simulate
from specdraft.learning.policies import POLICIES, RoundFeedback
from specdraft.learning.policies.bandits import Exp3Policy
from specdraft.learning.policies.halving import HalvingPolicy
from specdraft.learning.policies.hedge import normalhedge_scale


def test_no_policy_imports_torch():
    code = "import sys, specdraft.learning.policies, specdraft.learning.feedback; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("reward", ["bd", "be"])
def test_ucb_share_of_the_best_arm_goes_to_one(reward):
    driver = make("ucb", reward=reward, beta=0.01 if reward == "bd" else 0.2)
    chosen, _ = simulate(driver, Arms([0.3, 0.8, 0.5]), 1500)
    assert sorted(set(chosen[:3])) == [0, 1, 2]  # each arm once first
    assert share(chosen, 1, 500) > 0.95


@pytest.mark.parametrize("name", ["normalhedge", "hedge", "adanormalhedge"])
def test_hedge_family_finds_the_best_arm_and_regret_per_round_shrinks(name):
    driver = make(name, n=4)
    chosen, tracker = simulate(driver, Arms([0.3, 0.5, 0.85, 0.6]), 200, full=True)
    early = tracker.regret / 200
    chosen, tracker2 = simulate(driver, Arms([0.3, 0.5, 0.85, 0.6], seed=1), 1800, full=True)
    total = (tracker.regret + tracker2.regret) / 2000
    assert total < early
    assert share(chosen, 2, 500) > 0.9


def test_hedge_family_refuses_bandit_feedback():
    with pytest.raises(ValueError, match="full-information"):
        make("normalhedge").learn(RoundFeedback(0, K, 2, [0.5] * K))


@pytest.mark.parametrize("seed", range(5))
def test_normalhedge_normaliser_satisfies_its_equation(seed):
    rng = random.Random(seed)
    regrets = [rng.uniform(-3, 8) for _ in range(rng.randint(2, 9))]
    regrets[0] = abs(regrets[0]) + 0.1
    c = normalhedge_scale(regrets)
    mean = sum(math.exp(max(r, 0) ** 2 / (2 * c)) for r in regrets) / len(regrets)
    assert mean == pytest.approx(math.e, rel=1e-9)


def test_normalhedge_puts_no_weight_on_arms_with_negative_regret():
    policy = make("normalhedge").policy
    policy.weights_state = [2.0, -1.0, 0.5]
    p = policy.distribution()
    assert p[1] == 0.0 and p[0] > p[2] > 0 and sum(p) == pytest.approx(1.0)


def test_exp3_probabilities_follow_the_formula():
    driver = make("exp3", gamma=0.4)
    policy = driver.policy
    assert policy.probabilities() == pytest.approx([1 / 3] * 3)
    driver.learn(RoundFeedback(1, K, 3, [0.9] * K))
    w = [1.0, math.exp(0.4 * (0.9 / (1 / 3)) / 3), 1.0]
    expected = [(1 - 0.4) * wi / sum(w) + 0.4 / 3 for wi in w]
    assert policy.probabilities() == pytest.approx(expected)
    assert min(policy.probabilities()) >= 0.4 / 3 - 1e-12


def test_exp3_learns_the_best_arm():
    chosen, _ = simulate(make("exp3", gamma=0.1), Arms([0.2, 0.9, 0.4]), 1500)
    assert share(chosen, 1, 500) > 0.8


def test_halving_eliminates_the_worst_half_each_phase_then_commits():
    driver = make("halving", n=4, c=8.0)
    policy = driver.policy
    arms = Arms([0.2, 0.9, 0.5, 0.7], noise=0.0)
    seen = [list(policy.survivors)]
    for _ in range(200):
        driver.learn(arms.play(policy.select()))
        if policy.survivors != seen[-1]:
            seen.append(list(policy.survivors))
    assert [sorted(s) for s in seen] == [[0, 1, 2, 3], [1, 3], [1]]
    assert policy.committed and all(policy.select() == 1 for _ in range(5))


@pytest.mark.parametrize("name, options", [("ducb", {"discount": 0.97}), ("swucb", {"window": 60})])
def test_drifting_policies_recover_after_the_best_arm_changes(name, options):
    arms = Arms([0.8, 0.3, 0.5])
    chosen, _ = simulate(make(name, beta=0.05, **options), arms, 1500, change_at=700, new_rates=[0.2, 0.9, 0.5])
    assert share(chosen, 0, 300) < 0.1 < share(chosen[:700], 0, 300)
    assert share(chosen, 1, 300) > 0.8
    plain, _ = simulate(make("ucb", beta=0.05), Arms([0.8, 0.3, 0.5]), 1500, change_at=700, new_rates=[0.2, 0.9, 0.5])
    assert share(plain, 1, 300) < share(chosen, 1, 300)


@pytest.mark.parametrize("name", ["ucb", "normalhedge", "exp3", "halving"])
def test_goodput_objective_prefers_the_faster_arm_over_the_longer_one(name):
    # arm 0 accepts more per round but drafting costs 4x; arm 1 wins on tokens per second
    extra = {"gamma": 0.1} if name == "exp3" else {}
    goodput = make(name, n=2, objective="goodput", **extra)
    chosen, _ = simulate(goodput, Arms([0.8, 0.6], cost=[0.04, 0.01]), 800, full=name == "normalhedge")
    assert share(chosen, 1, 300) > 0.8
    papers, _ = simulate(make(name, n=2, **extra), Arms([0.8, 0.6], cost=[0.04, 0.01]), 800, full=name == "normalhedge")
    assert share(papers, 0, 300) > 0.8


def test_a_drafter_is_not_judged_on_more_tokens_than_the_chunk_could_show():
    """Full information sees each drafter only along the chosen arm's committed chunk. A
    cheap arm that commits one token a round must not make an aligned model drafter look
    slow by charging it for its best K while crediting at most that one token."""
    driver = make("normalhedge", n=2, objective="goodput", draft_length="goodput")
    rng = random.Random(0)

    def round_(arm, k):  # verify: 10 ms + 4 ms per token; arm 1 drafts at 1 ms a token
        accepted = 0
        while arm == 1 and accepted < k and rng.random() < 0.9:
            accepted += 1
        gammas = [[0.0] * (accepted + 1), [0.9] * (accepted + 1)]
        return RoundFeedback(arm, k, accepted, [0.9 if arm else 0.0] * k, 0.0, gammas,
                             draft_seconds=0.001 * k * arm, verify_seconds=0.01 + 0.004 * (k + 1))

    for k in (1, 2, 4, 5):  # both arms have drafted at several widths: costs are known
        driver.learn(round_(0, k))
        driver.learn(round_(1, k))
    for _ in range(30):  # the learner has been playing the cheap arm: one-token chunks
        driver.learn(round_(0, 1))
    assert driver.policy.select() == 1


def test_goodput_is_the_default_objective_with_dynamic_length_and_a_plain_arm():
    policy = POLICIES["ucb"](["a", "b"], {})
    assert policy.goodput and policy.options["draft_length"] == "goodput" and policy.options["allow_none"]


def test_halving_refuses_carry_and_the_default_carries():
    assert ("reset", 'must be "prompt" or "never" (halving explores each prompt from the start) (got \'carry\')') \
        in POLICIES["halving"].check_options({"reset": "carry"}, ["d0"])
    assert POLICIES["ucb"](["a", "b"], {}).options["reset"] == "carry"
    assert POLICIES["halving"](["a", "b"], {}).options["reset"] == "prompt"


def test_halving_budget_uses_the_horizon():
    policy = HalvingPolicy(["a", "b"], {"c": 2.0}, draft_tokens=K, horizon=100)
    assert policy.budget == math.ceil(2.0 * math.log(100))
    # one phase for two arms: each pulled budget // 2 times, round-robin
    assert policy.queue == [0, 1] * (policy.budget // 2)


def test_exp3_is_reproducible_with_a_seed():
    a = simulate(drive(Exp3Policy(["x", "y"], {}, seed=4)), Arms([0.4, 0.6]), 50)[0]
    b = simulate(drive(Exp3Policy(["x", "y"], {}, seed=4)), Arms([0.4, 0.6]), 50)[0]
    assert a == b


def test_adaptive_evaluation_interval_grows_with_a_clear_leader_and_resets_on_a_change():
    policy = make("normalhedge", update_every="adaptive").policy
    assert policy.evaluation_sampled and policy.evaluation_interval() == 1
    policy.weights_state = [5.0, -1.0, -2.0]  # arm 0 clearly best
    intervals = []
    for _ in range(6):
        policy.after_evaluation()
        intervals.append(policy.evaluation_interval())
    assert intervals == [1, 2, 4, 8, 16, 16]
    policy.weights_state = [-1.0, 5.0, -2.0]  # a new leader: evaluate every round again
    policy.after_evaluation()
    assert policy.evaluation_interval() == 1
    assert not make("normalhedge", update_every=3).policy.evaluation_sampled


def test_an_asleep_drafter_keeps_its_regret_and_its_acceptance():
    """Sleeping experts: a drafter silent at a round's start was no candidate there, so it
    takes the learner's loss (its regret does not move) and learns nothing about its drafts."""
    driver = make("normalhedge", n=3, objective="goodput", draft_length="goodput")
    policy, acceptance = driver.policy, driver.planner.acceptance
    arms = Arms([0.9, 0.3, 0.0])
    for _ in range(30):  # arm 0 leads
        driver.learn(arms.play(policy.select(), full=True))
    regret, before = list(policy.weights_state), acceptance.rates(0, 1)
    # A round where arm 0 was silent (its score 0 there) and arm 1 drafted well.
    driver.learn(RoundFeedback(1, K, 2, [1.0, 1.0, 0.0], 0.03, [[0.0] * 3, [1.0, 1.0, 0.0], [0.0] * 3], 0.0,
                               0.02, silent=[True, False, False]))
    assert policy.weights_state[0] == pytest.approx(regret[0])
    assert policy.weights_state[1] > regret[1]  # beat the learner among the awake arms
    assert acceptance.rates(0, 1) == before


@pytest.mark.parametrize("name", ["normalhedge", "hedge", "adanormalhedge", "ucb", "ducb", "swucb", "exp3", "random"])
def test_a_learner_passes_over_an_asleep_drafter_to_the_next_best(name):
    driver = make(name, n=3, seed=1)
    policy = driver.policy
    full = policy.full_information
    arms = Arms([0.9, 0.6, 0.1])
    for _ in range(80):
        driver.learn(arms.play(policy.select(), full=full))
    for _ in range(20):
        assert policy.select([False, True, True]) != 0
        assert policy.select([True, False, False]) == 0
    if name != "random":  # a learner's fallback is the better of the awake arms
        picks = [policy.select([False, True, True]) for _ in range(50)]
        assert picks.count(1) > picks.count(2)


def test_fixed_keeps_its_drafter_when_asleep():
    fixed = make("fixed", n=3, drafter="d0").policy
    assert fixed.select([False, True, True]) == 0  # fixed measures that drafter alone
    assert not fixed.chooses_by_context


def test_prompt_lookup_knows_where_it_would_propose():
    import torch

    from specdraft.core.sampling import SamplingParams
    from specdraft.drafters import DraftContext, NgramDrafter

    lookup = NgramDrafter("lookup", DraftContext(SamplingParams(), None, torch.device("cpu"), 64), 1, 2)
    context = [7, 1, 2, 3, 9, 1, 2]
    assert lookup.awake_at(context, 7)  # "1 2" occurred before, followed by 3
    assert not lookup.awake_at(context, 5)  # "9" never occurred before
    assert lookup.awake_at(context, 6)  # "1" did (followed by 2): asking again from earlier works
