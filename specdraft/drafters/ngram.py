"""Prompt lookup: continue the context the way it continued after the last earlier
occurrence of its final n tokens (n from max_ngram down to min_ngram).

The n-gram index grows incrementally with the context, so a round costs O(new tokens),
not a rescan of the whole prompt.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.drafters.base import (Draft, DraftContext, Drafter, Hidden, PoolContext, TrajectoryScores,
                                     proposal_trajectory_scores)
from specdraft.drafters.options import NgramOptions
from specdraft.learning.confidence import StopRule


class NgramDrafter(Drafter):
    kind = "ngram"
    may_stay_silent = True

    @classmethod
    def build(cls, name: str, options: NgramOptions, pool: PoolContext, key: str) -> "NgramDrafter":
        return cls(name, pool.draft, options.min_ngram, options.max_ngram)

    def __init__(self, name: str, ctx: DraftContext, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(name, ctx)
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.reset()

    def reset(self) -> None:
        # (n-gram) -> index just past its latest occurrence that has a continuation
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None) -> Draft:
        length = len(context)
        if length < self.indexed_to:  # a new context without reset(): start over
            self.reset()
        self._index_until(context, length)
        start = self._lookup(context, length)
        if start is None:
            return self.empty_draft()
        follow = list(context[start:start + k])
        return Draft(torch.tensor(follow, dtype=torch.long, device=self.ctx.device), None)

    def proposes_at(self, context: Sequence[int], position: int) -> bool:
        if position < self.indexed_to:  # the index already holds later n-grams: rebuild
            self.reset()
        self._index_until(context, position)
        return self._lookup(context, position) is not None

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        # Each position is scored by the one token a fresh lookup there would propose:
        # gamma = p(proposal), 0 when the lookup finds nothing.
        if start < self.indexed_to:  # the index already holds later n-grams: rebuild, never peek ahead
            self.reset()
        proposals = []
        for position in range(start, start + count):
            self._index_until(context, position)
            found = self._lookup(context, position)
            proposals.append(context[found] if found is not None else -1)
        tokens = torch.tensor(proposals, dtype=torch.long, device=target_probs.device)
        picked = target_probs.gather(-1, tokens.clamp_min(0).view(-1, 1)).squeeze(-1)
        return torch.where(tokens >= 0, picked, torch.zeros_like(picked))

    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        self.reset()
        return proposal_trajectory_scores(lambda position: self.propose(context[:position], k).tokens.tolist(),
                                          context, prompt_len, target_probs)

    def _lookup(self, context: Sequence[int], length: int) -> int | None:
        """Where the continuation of context[:length] starts, for the longest suffix found."""
        for n in self.sizes:
            if length > n:
                found = self.index.get(tuple(context[length - n:length]))
                if found is not None:
                    return found
        return None

    def _index_until(self, context: Sequence[int], length: int) -> None:
        # Position i ends an n-gram context[i-n:i] followed by context[i]; only i < length
        # has a continuation, and the latest occurrence wins.
        if length <= self.indexed_to:
            return
        for i in range(max(self.indexed_to, 1), length):
            for n in self.sizes:
                if i >= n:
                    self.index[tuple(context[i - n:i])] = i
        self.indexed_to = length
