"""`halving`: MetaSD's pure exploration then commit (PETC, Alg. 4) with sequential halving
(Karnin et al. 2013, Alg. 5) as the exploration phase.

The exploration budget is B0 = c ln B rounds (B = the generation budget in tokens).
Phase p pulls every surviving arm floor(B0 / (|S| * phases)) times (at least once) and
keeps the better half by mean reward; after ceil(log2 N) phases one arm is left and is
used for the rest of the generation, so switching costs stop once exploration ends.
"""

from __future__ import annotations

import math
from typing import Sequence

from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.policies.bandits import REWARD
from specdraft.learning.policies.base import OptionSpec, Policy, one_of
from specdraft.learning.policies.objective import chosen_reward


class HalvingPolicy(Policy):
    name = "halving"
    OPTIONS = {"c": OptionSpec((float, int), 4.0, lambda v: v > 0, "must be > 0", "exploration budget B0 = c ln B"),
               "reward": REWARD,
               # Its exploration budget is per generation: a carried prior has no phase to enter.
               "reset": OptionSpec((str,), "prompt", one_of("prompt", "never"),
                                   'must be "prompt" or "never" (halving explores each prompt from the start)',
                                   "forget what was learned before each prompt, or keep learning across prompts")}
    STATE = ("survivors", "phase", "queue", "sums", "counts")
    COUNTS = ("phase", "counts")
    ARM_INDICES = ("survivors", "queue")

    def fresh(self) -> None:
        n = len(self.arms)
        self.phases = max(1, math.ceil(math.log2(n))) if n > 1 else 0
        self.budget = max(1, math.ceil(self.options["c"] * math.log(max(self.horizon, 2))))
        self.survivors = list(range(n))
        self.phase = 0
        self.sums = [0.0] * n
        self.counts = [0] * n
        self.queue: list[int] = []
        self._plan_phase()

    def _plan_phase(self) -> None:
        if self.phase >= self.phases:
            self.queue = []
            return
        pulls = max(1, self.budget // (len(self.survivors) * self.phases))
        self.queue = [arm for _ in range(pulls) for arm in self.survivors]  # round-robin
        self.sums = [0.0] * len(self.arms)
        self.counts = [0] * len(self.arms)

    @property
    def committed(self) -> bool:
        return len(self.survivors) == 1

    def select(self, awake: Sequence[bool] | None = None) -> int:
        # The exploration schedule is fixed (each survivor its share of pulls, in turn), so
        # the awake mask matters only once one arm is left, and there is nothing to choose.
        probe = self.planner.cost_probe()
        if probe is not None:
            return probe
        return self.queue[0] if self.queue else self.survivors[0]

    @property
    def chooses_by_context(self) -> bool:
        return False

    def learn(self, fb: RoundFeedback) -> None:
        if not self.queue or fb.arm != self.queue[0]:
            return  # committed, or a cost probe outside the schedule
        self.queue.pop(0)
        self.sums[fb.arm] += chosen_reward(self.planner, fb, self.options["reward"])
        self.counts[fb.arm] += 1
        if not self.queue:
            ranked = sorted(self.survivors, key=lambda a: self.sums[a] / max(self.counts[a], 1), reverse=True)
            self.survivors = ranked[: math.ceil(len(ranked) / 2)]
            self.phase += 1
            self._plan_phase()

    def scores(self) -> dict[str, float]:
        return {a: (1.0 if i in self.survivors else 0.0) for i, a in enumerate(self.arms)}
