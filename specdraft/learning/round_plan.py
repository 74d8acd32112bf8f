"""What a round's plan holds (`RoundPlanner.plan` decides it, the engine and replay run it).
Plain Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.learning.confidence import StopRule
from specdraft.learning.tree_planner import Branches


@dataclass(frozen=True)
class RoundPlan:
    """What was decided for one round, and what is expected of it."""

    arm: int
    draft_tokens: int  # K for this round (0 = a plain decoding round)
    # Early stop: when one more draft token stops paying for its time; None before costs
    # are known, and with draft_length = "fixed".
    stop: StopRule | None = None
    expected_tokens: float | None = None  # E[committed | arm, K] (of the whole tree, with branches)
    expected_seconds: float | None = None  # T(arm, K)
    # Further drafters' chains verified with the chosen one's as a token tree, (arm, depth)
    # each (learning/tree_planner.py); empty: a one-chain round.
    branches: Branches = ()
    # (arm, n, width): that chain's drafter's `width` runner-ups at each of its first n
    # positions are verified as leaves beside it (a tree round even without branches).
    runner_ups: tuple[tuple[int, int, int], ...] = ()
