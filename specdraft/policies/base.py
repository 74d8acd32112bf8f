"""The policy interface: what the decode core tells a policy and what it asks of it.

Policies are plain Python (no torch): `select()` returns the index of the drafter for the
next round, `update(feedback)` learns from the round's alignment feedback. Each policy
declares its options (name -> OptionSpec) so a profile's `[policy]` table is validated
before any model loads.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence


@dataclass(frozen=True)
class RoundFeedback:
    """What one round reveals. `alphas[j]` = 1 - TV(p_j, q_j) at drafted position j."""

    arm: int
    drafted: int
    accepted: int  # drafted tokens accepted (the bonus/recovered token not counted)
    alphas: Sequence[float] = ()
    round_seconds: float = 0.0


@dataclass(frozen=True)
class OptionSpec:
    types: tuple[type, ...]
    default: Any
    check: Callable[[Any], bool] = lambda value: True
    requirement: str = ""
    help: str = ""


class Policy(ABC):
    """Chooses one arm (drafter index) per round."""

    name: ClassVar[str]
    OPTIONS: ClassVar[dict[str, OptionSpec]] = {}

    def __init__(self, arms: Sequence[str], options: dict[str, Any] | None = None, seed: int | None = None):
        if not arms:
            raise ValueError("a policy needs at least one arm")
        self.arms = list(arms)
        self.options = {k: spec.default for k, spec in self.OPTIONS.items()} | dict(options or {})
        self.rng = random.Random(seed)
        self.reset()

    def reset(self) -> None:
        """Forget what was learned (called before each prompt unless state is kept)."""

    @abstractmethod
    def select(self) -> int: ...

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round; policies that learn nothing keep this default."""

    def scores(self) -> dict[str, float] | None:
        """Per-arm weight or index for the live panel, or None when the policy has none."""
        return None


@dataclass
class ArmCounts:
    """Counts shared by several policies: pulls and summed reward per arm."""

    pulls: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)

    @classmethod
    def zeros(cls, n: int) -> "ArmCounts":
        return cls([0] * n, [0.0] * n)
