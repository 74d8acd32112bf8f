"""Alignment feedback: the expected-acceptance-length estimator is unbiased (HedgeSpec
Theorem 3), checked against Monte-Carlo speculative sampling on a Markov chain."""

from __future__ import annotations

import numpy as np
import pytest

from specdraft.learning.feedback import (RegretTracker, acceptance_loss, bd_reward, be_reward, expected_accept_length,
                                length_loss)


def test_eal_edge_cases():
    assert expected_accept_length([]) == 1.0
    assert expected_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_accept_length([0.0, 1.0]) == 1.0
    assert expected_accept_length([0.5]) == pytest.approx(1.5)
    assert expected_accept_length([0.5, 0.5]) == pytest.approx(1 * 0.5 + 2 * 0.25 + 3 * 0.25)
    assert length_loss([1.0] * 5, 5) == 0.0 and length_loss([0.0] * 5, 5) == pytest.approx(5 / 6)
    assert acceptance_loss([0.25, 0.75]) == 0.5 and bd_reward([0.2, 0.4]) == pytest.approx(0.3)
    assert be_reward(2, 4) == 0.5 and be_reward(0, 0) == 0.0


def test_eal_mean_matches_monte_carlo_accept_lengths():
    """Sampling on a Markov chain where the acceptance probability does not depend on which
    token was accepted (p and q are shifts of fixed laws): the estimator's mean over
    trajectories drawn from the target matches real speculative-sampling rounds."""
    rng = np.random.default_rng(0)
    vocab, k, draws = 5, 4, 12000
    base_p, base_q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    p = np.stack([np.roll(base_p, x) for x in range(vocab)])  # p(y | x) = base_p[y - x]
    q = np.stack([np.roll(base_q, x) for x in range(vocab)])
    overlap = np.minimum(p, q).sum(axis=1)

    def speculative_round(x: int) -> int:
        for j in range(k):
            y = rng.choice(vocab, p=q[x])
            if rng.random() >= min(1.0, p[x, y] / q[x, y]):
                return j + 1  # j accepted + the recovered token
            x = y
        return k + 1

    def estimate(x: int) -> float:
        gammas = []
        for _ in range(k):
            gammas.append(overlap[x])
            x = rng.choice(vocab, p=p[x])
        return expected_accept_length(gammas)

    mc = np.mean([speculative_round(int(rng.integers(vocab))) for _ in range(draws)])
    est = np.mean([estimate(int(rng.integers(vocab))) for _ in range(draws)])
    standard_error = np.std([speculative_round(0) for _ in range(2000)]) / np.sqrt(draws)
    assert abs(est - mc) < 4 * standard_error + 1e-3


def test_eal_equals_the_greedy_accept_run_exactly():
    """Greedy: gamma is 1 where the drafter's token is the target's argmax, else 0, and the
    estimator is the accepted run (capped at K) plus one, on every start state."""
    rng = np.random.default_rng(1)
    vocab, k = 6, 4
    target_next = rng.integers(vocab, size=vocab)  # argmax of the target given the previous token
    drafter_next = np.where(rng.random(vocab) < 0.6, target_next, rng.integers(vocab, size=vocab))
    for start in range(vocab):
        x, run = start, 0
        while run < k and drafter_next[x] == target_next[x]:
            x, run = target_next[x], run + 1
        gammas, x = [], start
        for _ in range(k):
            gammas.append(float(drafter_next[x] == target_next[x]))
            x = target_next[x]
        assert expected_accept_length(gammas) == run + 1


def test_regret_tracker():
    tracker = RegretTracker(["a", "b"])
    tracker.add(0, [1.0, 3.0])
    tracker.add(1, [2.0, 3.0])
    assert tracker.best == 1 and tracker.regret == pytest.approx(6.0 - 4.0) and tracker.best_arm_share == 0.5


def test_an_arm_skipped_in_most_rounds_is_not_named_best_on_credit_it_never_earned():
    """Issue 38: a drafter the evaluation skipped (gammas None) used to be credited with the
    chosen arm's value, so one good scored round made it "best" over a drafter that earned
    every round. Now it earns only the rounds it was scored in."""
    tracker = RegretTracker(["lookup", "early-exit-24", "small"])
    chosen, rare, steady = [1.0, 0.0], [1.0, 1.0, 0.0], [0.8, 0.0]  # EAL 2.0, 3.0, 1.8
    for t in range(10):
        tracker.add_round(0, [chosen, rare if t == 3 else None, steady], 4)
    assert tracker.scored == [10, 1, 10]
    assert tracker.totals == pytest.approx([20.0, 3.0, 18.0])
    assert tracker.best == 0 and tracker.regret == pytest.approx(0.0) and tracker.best_arm_share == 1.0
    assert tracker.unit == "tokens" and tracker.rounds == 10


def test_regret_is_zero_when_the_learner_played_the_best_arm_and_exact_when_all_are_scored():
    tracker = RegretTracker(["a", "b"], unit="tok/s")
    for a, b in [(200.0, 150.0), (120.0, 119.0), (90.0, None), (300.0, 10.0)]:
        tracker.add(0, [a, b])
    assert tracker.best == 0 and tracker.regret == 0.0
    full = RegretTracker(["a", "b"], unit="tok/s")
    for a, b in [(200.0, 210.0), (120.0, 130.0), (90.0, 100.0)]:
        full.add(0, [a, b])
    assert full.best == 1 and full.regret == pytest.approx(440.0 - 410.0)  # the usual regret
    full.add(1, [50.0, None])  # the chosen arm unpriced: nothing to compare with, not tracked
    assert full.rounds == 3
