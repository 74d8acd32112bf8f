"""Prompt lookup: continue the context the way it continued after the last earlier
occurrence of its final n tokens (n from max_ngram down to min_ngram).

The n-gram index grows incrementally with the context, so a round costs O(new tokens),
not a rescan of the whole prompt.
"""

from __future__ import annotations

from typing import Sequence

from specdraft.drafters.base import DraftContext, PoolContext
from specdraft.drafters.lookup_base import LookupDrafter
from specdraft.drafters.options import NgramOptions


class NgramDrafter(LookupDrafter):
    kind = "ngram"

    @classmethod
    def build(cls, name: str, options: NgramOptions, pool: PoolContext, key: str, index: int) -> "NgramDrafter":
        return cls(name, pool.draft, options.min_ngram, options.max_ngram)

    def __init__(self, name: str, ctx: DraftContext, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(name, ctx)
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.reset()

    def reset(self) -> None:
        # (n-gram) -> index just past its latest occurrence that has a continuation
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0

    def lookup(self, context: Sequence[int], position: int, k: int, stop_price: float | None = None) -> list[int]:
        if position < self.indexed_to:  # the index holds later n-grams (a new prompt): rebuild, never peek ahead
            self.reset()
        self._index_until(context, position)
        start = self._continuation(context, position)
        return [] if start is None else list(context[start : min(start + k, position)])

    def _continuation(self, context: Sequence[int], length: int) -> int | None:
        """Where the continuation of context[:length] starts, for the longest suffix found."""
        for n in self.sizes:
            if length > n:
                found = self.index.get(tuple(context[length - n:length]))
                if found is not None:
                    self.last_match = n
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
