"""MetaSD's bandit policies (bandit feedback: only the chosen drafter's round is scored).

- `ucb`   MetaSD-UCB (Alg. 2): each arm once, then argmax mu_i + beta sqrt(2 ln t / n_i).
- `ducb`  discounted UCB (Alg. 6) for drifting prompts.
- `swucb` sliding-window UCB (Alg. 8).
- `exp3`  MetaSD-EXP3 (Alg. 7): exponential weights on importance-weighted rewards.

The reward is built on BD (mean 1 - TV over drafted positions, default) or BE (accepted /
drafted): with the goodput objective (default) the round's expected committed tokens turn
into an estimated speedup over plain decoding; with objective = "acceptance" the reward is
BD or BE itself, as in the paper.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.policies.base import OptionSpec, Policy, one_of, scaled
from specdraft.learning.policies.objective import chosen_reward

REWARD = OptionSpec((str,), "bd", one_of("bd", "be"), 'must be "bd" or "be"',
                    "bd: block divergence (mean 1 - TV); be: block efficiency (accepted / drafted)")
BETA = OptionSpec((float, int), 0.01, lambda v: v >= 0, "must be >= 0", "exploration strength")


class UCBPolicy(Policy):
    name = "ucb"
    OPTIONS = {"beta": BETA, "reward": REWARD}
    STATE = ("pulls", "means", "t")
    COUNTS = ("pulls", "t")

    def fresh(self) -> None:
        self.pulls = [0] * len(self.arms)
        self.means = [0.0] * len(self.arms)
        self.t = 0

    def carry_in(self, snapshot: dict, factor: float) -> None:
        # The same means on fewer pulls: wider confidence bounds, so a few rounds of new
        # evidence can move them. An arm never pulled stays untried.
        self.means = list(snapshot["means"])
        self.pulls = scaled(snapshot["pulls"], factor)
        self.t = sum(self.pulls)

    def index(self, arm: int) -> float:
        if self.pulls[arm] == 0:
            return math.inf
        bonus = math.sqrt(2 * math.log(max(self.t, 1)) / self.pulls[arm])
        return self.means[arm] + self.options["beta"] * bonus

    def select(self, awake: Sequence[bool] | None = None) -> int:
        # Sleeping bandits (Kleinberg et al. 2010): the awake arm with the highest index.
        probe = self.planner.cost_probe(awake)
        if probe is not None:
            return probe
        return max(self.awake_arms(awake), key=self.index)

    def learn(self, fb: RoundFeedback) -> None:
        reward = chosen_reward(self.planner, fb, self.options["reward"])
        self.t += 1
        self.pulls[fb.arm] += 1
        self.means[fb.arm] += (reward - self.means[fb.arm]) / self.pulls[fb.arm]

    def scores(self) -> dict[str, float]:
        return {a: (self.index(i) if self.pulls[i] else float("nan")) for i, a in enumerate(self.arms)}


class DiscountedUCBPolicy(UCBPolicy):
    """Kocsis & Szepesvári's D-UCB in the standard form: discounted reward sums over
    discounted counts, and a bonus from the discounted counts. (MetaSD's Alg. 6 divides
    the discounted sum by the undiscounted count, which drags every mean towards 0.)"""

    name = "ducb"
    OPTIONS = {"beta": BETA, "reward": REWARD,
               "discount": OptionSpec((float,), 0.95, lambda v: 0 < v <= 1, "must be in (0, 1]",
                                      "weight kept by a past round per round that passes")}
    STATE = ("pulls", "weights", "sums", "t")
    COUNTS = ("pulls", "weights", "t")

    def fresh(self) -> None:
        super().fresh()
        self.weights = [0.0] * len(self.arms)  # discounted pull counts
        self.sums = [0.0] * len(self.arms)  # discounted reward sums

    def carry_in(self, snapshot: dict, factor: float) -> None:
        self.pulls = scaled(snapshot["pulls"], factor)
        self.weights = scaled(snapshot["weights"], factor)
        self.sums = scaled(snapshot["sums"], factor)
        self.t = sum(self.pulls)

    def index(self, arm: int) -> float:
        if self.weights[arm] <= 1e-12:
            return math.inf
        total = sum(self.weights)
        bonus = math.sqrt(2 * math.log(max(total, 1.0)) / self.weights[arm])
        return self.sums[arm] / self.weights[arm] + self.options["beta"] * bonus

    def learn(self, fb: RoundFeedback) -> None:
        reward = chosen_reward(self.planner, fb, self.options["reward"])
        g = self.options["discount"]
        self.weights = [w * g for w in self.weights]
        self.sums = [s * g for s in self.sums]
        self.weights[fb.arm] += 1.0
        self.sums[fb.arm] += reward
        self.pulls[fb.arm] += 1
        self.t += 1


class SlidingWindowUCBPolicy(UCBPolicy):
    name = "swucb"
    OPTIONS = {"beta": BETA, "reward": REWARD,
               "window": OptionSpec((int,), 50, lambda v: v >= 1, "must be at least 1",
                                    "how many recent rounds the means look at")}
    STATE = ("history", "t")
    COUNTS = ("t",)

    def fresh(self) -> None:
        super().fresh()
        self.history: deque = deque(maxlen=self.options["window"])

    def check_loaded(self, state: dict) -> None:
        for entry in state.get("history", ()):
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
                    and 0 <= entry[0] < len(self.arms) and entry[1] is not None):
                raise ValueError("state field history: expected [arm, reward] pairs")

    def carry_in(self, snapshot: dict, factor: float) -> None:
        # The window itself bounds the evidence, and cutting it shorter would leave arms with
        # no rounds in it (untried again): the window carries over whole.
        self.history.extend(snapshot["history"])
        self.t = len(self.history)

    def index(self, arm: int) -> float:
        rewards = [r for a, r in self.history if a == arm]
        if not rewards:
            return math.inf
        bonus = math.sqrt(2 * math.log(max(min(self.t, len(self.history)), 1)) / len(rewards))
        return sum(rewards) / len(rewards) + self.options["beta"] * bonus

    def learn(self, fb: RoundFeedback) -> None:
        self.history.append((fb.arm, chosen_reward(self.planner, fb, self.options["reward"])))
        self.t += 1

    def scores(self) -> dict[str, float]:
        return {a: self.index(i) for i, a in enumerate(self.arms)}


class Exp3Policy(Policy):
    name = "exp3"
    OPTIONS = {"gamma": OptionSpec((float,), 0.4, lambda v: 0 < v <= 1, "must be in (0, 1]",
                                   "share of uniform exploration (and learning rate)"),
               "reward": REWARD}
    STATE = ("log_weights",)

    def fresh(self) -> None:
        self.log_weights = [0.0] * len(self.arms)
        self.chosen_probability: float | None = None  # P(the last selected arm), set by select

    def carry_in(self, snapshot: dict, factor: float) -> None:
        self.log_weights = scaled(snapshot["log_weights"], factor)  # a flatter distribution, same order

    def probabilities(self) -> list[float]:
        top = max(self.log_weights)
        w = [math.exp(lw - top) for lw in self.log_weights]  # shifted: no overflow
        total, gamma, n = sum(w), self.options["gamma"], len(self.arms)
        return [(1 - gamma) * wi / total + gamma / n for wi in w]

    def select(self, awake: Sequence[bool] | None = None) -> int:
        probe = self.planner.cost_probe(awake)
        if probe is not None:
            self.chosen_probability = 1.0
            return probe
        arms = self.awake_arms(awake)
        p = self.probabilities()
        weights = [p[i] for i in arms]
        arm = self.rng.choices(arms, weights=weights)[0]
        # The importance weight is the probability the arm really had: among the awake ones.
        self.chosen_probability = p[arm] / sum(weights)
        return arm

    def learn(self, fb: RoundFeedback) -> None:
        p, self.chosen_probability = self.chosen_probability or self.probabilities()[fb.arm], None
        estimate = chosen_reward(self.planner, fb, self.options["reward"]) / p
        self.log_weights[fb.arm] += self.options["gamma"] * estimate / len(self.arms)

    def scores(self) -> dict[str, float]:
        return dict(zip(self.arms, self.probabilities()))
