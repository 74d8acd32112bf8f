"""Simulated arms with known acceptance, and policies driven through them as the
PolicyDriver drives them (the planner learns each round first, then the policy): what
tests/test_policies.py and tests/test_policy_driver.py simulate with."""

from __future__ import annotations

import random

from specdraft.learning.driver import PolicyDriver
from specdraft.learning.feedback import RegretTracker, expected_accept_length
from specdraft.learning.policies import POLICIES, RoundFeedback

K = 5


class Arms:
    """Arms whose per-position acceptance probability is `rates[i]` (changeable mid-stream)."""

    def __init__(self, rates, seed=0, noise=0.05, cost=None):
        self.rates = list(rates)
        self.rng = random.Random(seed)
        self.noise = noise
        self.cost = cost or [0.01] * len(rates)

    def gamma(self, arm):
        return min(1.0, max(0.0, self.rates[arm] + self.rng.uniform(-self.noise, self.noise)))

    def play(self, arm, full=False):
        accepted = 0
        while accepted < K and self.rng.random() < self.rates[arm]:
            accepted += 1
        count = accepted + 1  # committed positions this round
        alphas = [self.gamma(arm) for _ in range(K)]
        gammas = [[self.gamma(i) for _ in range(count)] for i in range(len(self.rates))] if full else None
        if full:
            gammas[arm][: min(count, K)] = alphas[: min(count, K)]
        # The round's time: its draft (the arm's cost) and a verify of K + 1 tokens.
        return RoundFeedback(arm, K, accepted, alphas, self.cost[arm] + 0.01, gammas,
                             draft_seconds=self.cost[arm], verify_seconds=0.01)


def simulate(driver, arms, rounds, full=False, change_at=None, new_rates=None):
    """`rounds` rounds of `driver`'s policy on `arms`, each learned from as the driver does
    (its planner first, then the policy)."""
    chosen, tracker = [], RegretTracker(driver.policy.arms)
    for t in range(rounds):
        if t == change_at:
            arms.rates = list(new_rates)
        arm = driver.policy.select()
        fb = arms.play(arm, full)
        driver.learn(fb)
        chosen.append(arm)
        if full:
            tracker.add(arm, [expected_accept_length(g[:K]) for g in fb.gammas])
    return chosen, tracker


# The papers' setting, what these simulations test: each prompt learns from scratch.
PAPERS = {"objective": "acceptance", "draft_length": "fixed", "reset": "prompt"}


def make(name, n=3, seed=0, **options):
    """Policy `name` over n arms with the driver that owns its round planner."""
    return drive(POLICIES[name]([f"d{i}" for i in range(n)], PAPERS | options, seed=seed, draft_tokens=K, horizon=512))


def drive(policy):
    return PolicyDriver(policy, K, 10_000)


def share(chosen, arm, last):
    return chosen[-last:].count(arm) / last
