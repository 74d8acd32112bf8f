"""Prompt lookup: continue the context the way it continued after the last earlier
occurrence of its final n tokens (n from max_ngram down to min_ngram).

The n-gram index grows incrementally with the context, so a round costs O(new tokens),
not a rescan of the whole prompt. It keeps every occurrence, so a lookup at an earlier
position (full-information scoring of committed tokens) finds the latest occurrence
before it by bisection instead of re-indexing the text up to there.
"""

from __future__ import annotations

from bisect import bisect_left
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
        # (n-gram) -> every index just past one of its occurrences that has a continuation,
        # ascending (the text is indexed left to right)
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.indexed_to = 0

    def lookup(self, context: Sequence[int], position: int, k: int, stop_price: float | None = None) -> list[int]:
        self._index_until(context, position)
        start = self._continuation(context, position)
        return [] if start is None else list(context[start : min(start + k, position)])

    def _continuation(self, context: Sequence[int], length: int) -> int | None:
        """Where the continuation of context[:length] starts, for the longest suffix found:
        its latest occurrence whose continuation lies before `length` (never peeks ahead)."""
        for n in self.sizes:
            if length > n:
                found = self.index.get(tuple(context[length - n:length]))
                if found:
                    before = bisect_left(found, length)
                    if before:
                        self.last_match = n
                        return found[before - 1]
        return None

    def _index_until(self, context: Sequence[int], length: int) -> None:
        # Position i ends an n-gram context[i-n:i] followed by context[i]; only i < length
        # has a continuation. zip builds each size's n-grams without a slice per position.
        if length <= self.indexed_to:
            return
        index = self.index
        for n in reversed(self.sizes):  # any order: each size's positions stay ascending
            first = max(self.indexed_to, n)
            grams = zip(*(context[first - n + j:length - n + j] for j in range(n)))
            for i, key in enumerate(grams, start=first):
                found = index.get(key)
                if found is None:
                    index[key] = [i]
                else:
                    found.append(i)
        self.indexed_to = length
