"""Baseline policies: `fixed` (always one named drafter) and `random` (uniform per round)."""

from __future__ import annotations

from specdraft.policies.base import OptionSpec, Policy


class FixedPolicy(Policy):
    name = "fixed"
    OPTIONS = {
        "drafter": OptionSpec((str,), None, help="name of the drafter to use every round"),
    }

    def fresh(self) -> None:
        drafter = self.options["drafter"]
        self.arm = self.arms.index(drafter) if drafter is not None else 0

    def select(self) -> int:
        return self.arm


class RandomPolicy(Policy):
    name = "random"

    def select(self) -> int:
        return self.rng.randrange(len(self.arms))
