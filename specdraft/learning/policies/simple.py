"""Baseline policies: `fixed` (always one named drafter) and `random` (uniform per round)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from specdraft.learning.policies.base import OptionSpec, Policy


class FixedPolicy(Policy):
    name = "fixed"
    OPTIONS = {
        "drafter": OptionSpec((str,), None, help="name of the drafter to use every round"),
    }

    @classmethod
    def check_options(cls, options: Mapping[str, Any], drafters: Sequence[str]) -> list[tuple[str, str]]:
        problems = super().check_options(options, drafters)
        if not problems and options.get("drafter") is None and len(drafters) > 1:
            problems.append(("drafter", "fixed needs drafter = the name of one drafter in the pool"))
        return problems

    def fresh(self) -> None:
        drafter = self.options["drafter"]
        self.arm = self.arms.index(drafter) if drafter is not None else 0

    def select(self, awake: Sequence[bool] | None = None) -> int:
        return self.arm  # a silent drafter makes its round a plain one: that is what "fixed" measures

    @property
    def chooses_by_context(self) -> bool:
        return False


class RandomPolicy(Policy):
    name = "random"

    def select(self, awake: Sequence[bool] | None = None) -> int:
        return self.rng.choice(self.awake_arms(awake))
