"""The `none` arm: plain decoding for a round (no draft, one target step)."""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter, DrafterTraits, Hidden, TrajectoryScores
from specdraft.learning.confidence import StopRule


class PlainDecoding(Drafter):
    """Never asleep: it is the round every asleep drafter would have turned into."""

    kind = "none"
    traits = DrafterTraits(drafts_nothing=True)

    def __init__(self, ctx: DraftContext, name: str = "none"):
        super().__init__(name, ctx)

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        return self.empty_draft()

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        return target_probs.new_zeros(count)  # proposes nothing, so nothing is ever accepted

    def committed_scores(self, context: Sequence[int], start: int, count: int) -> list[float]:
        return [0.0] * count

    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        n = len(context) - prompt_len
        return TrajectoryScores([0.0] * n, [0] * n, [0] * n, [[] for _ in range(n)])
