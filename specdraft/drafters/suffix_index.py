"""A token text indexed for "where else did the last m tokens occur?", for the suffix drafter.

`SuffixIndex` holds documents concatenated into one int32 array (each preceded by a -1
separator) and every position sorted by the text read *backwards* from it, up to `depth`
tokens: a suffix array of the reversed text, cut at a fixed depth. The context's last
token, then the one before, ... narrow a contiguous range of that order one token at a
time (the backward search of an FM-index), so finding the longest earlier occurrence of the
context's suffix costs O(match length x log N) token reads and does not grow with the store
beyond that logarithm. The positions in the final range are where the match ends; what
followed each of them is read forward from the text.

`ContextIndex` answers the same question for the current prompt and output, which change
every round, by a vectorised backward scan (the context is short: a few thousand tokens).

Both return `Occurrences`: the matched length and the positions just after each occurrence
(capped, evenly spread over the range so frequent continuations stay frequent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SEPARATOR = -1
MAX_OCCURRENCES = 256  # positions kept per source: enough to rank continuations


@dataclass(frozen=True)
class Occurrences:
    length: int  # tokens matched (0: none)
    text: np.ndarray  # int32 text the positions index
    after: np.ndarray  # int64 positions just past each occurrence (the next token's index)


def build_order(text: np.ndarray, depth: int) -> np.ndarray:
    """Positions of `text` (not separators), sorted by the tokens read backwards from each,
    compared over `depth` tokens (prefix doubling: log2(depth) sorts of N keys)."""
    n = len(text)
    rank = text.astype(np.int64) + 2  # separators rank 1; reading past the start ranks 0
    h = 1
    while h < depth:
        shifted = np.zeros(n, dtype=np.int64)
        if h < n:
            shifted[h:] = rank[:-h]
        key = rank * (int(rank.max()) + 1) + shifted  # (rank of the last h tokens, rank of the h before)
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        fresh = np.empty(n, dtype=np.int64)
        fresh[order] = np.concatenate(([0], np.cumsum(sorted_key[1:] != sorted_key[:-1]))) + 1
        rank = fresh
        h *= 2
        if rank.max() == n:  # every position already distinct
            break
    order = np.argsort(rank, kind="stable")
    order = order[text[order] != SEPARATOR]
    return order.astype(np.int32 if n < 2**31 else np.int64)


class SuffixIndex:
    """An immutable indexed text; `order` from `build_order` (or a memory map of it)."""

    def __init__(self, text: np.ndarray, order: np.ndarray, depth: int):
        self.text = text
        self.order = order
        self.depth = depth

    @classmethod
    def from_documents(cls, documents: Sequence[Sequence[int]], depth: int) -> "SuffixIndex":
        return cls.build(concatenate(documents), depth)

    @classmethod
    def build(cls, text: np.ndarray, depth: int) -> "SuffixIndex":
        return cls(text, build_order(text, depth), depth)

    @property
    def tokens(self) -> int:
        return len(self.order)

    def longest_match(self, context: Sequence[int], max_match: int) -> Occurrences:
        """The longest suffix of `context` (up to max_match and the sort depth) found here."""
        lo, hi = 0, len(self.order)
        length = 0
        limit = min(max_match, self.depth, len(context))
        while length < limit and hi > lo:
            token = int(context[len(context) - 1 - length])
            new_lo, new_hi = self._narrow(lo, hi, length, token)
            if new_hi <= new_lo:
                break
            lo, hi, length = new_lo, new_hi, length + 1
        if length == 0:
            return Occurrences(0, self.text, np.empty(0, dtype=np.int64))
        ends = self.order[lo:hi] if hi - lo <= MAX_OCCURRENCES else \
            self.order[np.linspace(lo, hi - 1, MAX_OCCURRENCES).astype(np.int64)]
        return Occurrences(length, self.text, np.asarray(ends, dtype=np.int64) + 1)

    def _key(self, i: int, offset: int) -> int:
        position = int(self.order[i]) - offset
        return int(self.text[position]) if position >= 0 else SEPARATOR - 1

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) whose token `offset` places back is `token` (sorted there)."""
        if hi - lo <= 4096:  # one vectorised read beats ~2 log2(n) scalar reads
            positions = self.order[lo:hi].astype(np.int64) - offset
            keys = np.where(positions >= 0, self.text[np.maximum(positions, 0)], SEPARATOR - 1)
            return lo + int(np.searchsorted(keys, token, "left")), lo + int(np.searchsorted(keys, token, "right"))
        first, last = lo, hi
        while first < last:  # first index with key >= token
            mid = (first + last) // 2
            if self._key(mid, offset) < token:
                first = mid + 1
            else:
                last = mid
        end, last = first, hi
        while end < last:  # first index with key > token
            mid = (end + last) // 2
            if self._key(mid, offset) <= token:
                end = mid + 1
            else:
                last = mid
        return first, end


class ContextIndex:
    """The current prompt and output, grown in place as rounds commit tokens."""

    def __init__(self) -> None:
        self.text = np.full(1024, SEPARATOR, dtype=np.int32)
        self.length = 0

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with `context` (the committed tokens); a shorter one starts over."""
        n = len(context)
        if n < self.length:
            self.length = 0
        if n > len(self.text):
            grown = np.full(max(n, 2 * len(self.text)), SEPARATOR, dtype=np.int32)
            grown[:self.length] = self.text[:self.length]
            self.text = grown
        if n > self.length:
            self.text[self.length:n] = np.asarray(context[self.length:n], dtype=np.int32)
            self.length = n

    def longest_match(self, length: int, max_match: int) -> Occurrences:
        """The longest suffix of text[:length] that also occurs earlier in it."""
        text = self.text
        if length < 2:
            return Occurrences(0, text, np.empty(0, dtype=np.int64))
        ends = np.flatnonzero(text[:length - 1] == text[length - 1])
        matched = 1 if len(ends) else 0
        while len(ends) and matched < max_match:
            behind = ends - matched
            keep = ends[(behind >= 0) & (text[np.maximum(behind, 0)] == text[length - 1 - matched])]
            if not len(keep):
                break
            ends, matched = keep, matched + 1
        if len(ends) > MAX_OCCURRENCES:  # the latest occurrences: recent text predicts best
            ends = ends[-MAX_OCCURRENCES:]
        return Occurrences(matched, text[:length], ends + 1)


def concatenate(documents: Sequence[Sequence[int]]) -> np.ndarray:
    """One int32 text: every document preceded by a separator, and one at the end."""
    total = sum(len(d) for d in documents) + len(documents) + 1
    text = np.full(total, SEPARATOR, dtype=np.int32)
    at = 1
    for document in documents:
        text[at:at + len(document)] = np.asarray(document, dtype=np.int32)
        at += len(document) + 1
    return text


@dataclass(frozen=True)
class Continuation:
    tokens: list[int]
    chances: list[float]  # running product of the chosen tokens' frequencies, after each
    # Expected tokens accepted by the same model with every frequency count / (total + 1):
    # what ranks sources, so that thin evidence (one earlier occurrence) does not outrank
    # a draft many occurrences agree on.
    score: float


FEW = 64  # occurrences counted in Python rather than with np.unique


def continue_occurrences(sources: Sequence[Occurrences], max_tokens: int, min_prob: float,
                         first_rank: int = 1) -> Continuation:
    """Follow the occurrences forward, most frequent next token first (SuffixDecoding's
    score): each step keeps the occurrences that continued with the chosen token, and the
    draft stops when the product of the chosen tokens' frequencies falls below min_prob.
    `first_rank` r > 1 starts from the r-th most frequent next token instead (nothing where
    fewer than r tokens followed), the way SuffixDecoding's tree holds other continuations."""
    live = [(s.text, s.after) for s in sources if len(s.after)]
    tokens: list[int] = []
    chances: list[float] = []
    chance, cautious, score = 1.0, 1.0, 0.0
    while live and len(tokens) < max_tokens:
        counts: dict[int, int] = {}
        nexts = []
        for text, after in live:
            inside = after[after < len(text)]
            following = text[inside]
            nexts.append((text, inside, following))
            if len(following) <= FEW:  # np.unique's fixed cost dwarfs a few tokens' count
                local: dict[int, int] = {}
                for value in following.tolist():
                    if value != SEPARATOR:
                        local[value] = local.get(value, 0) + 1
                for value in sorted(local):  # np.unique's order: ties break as they did
                    counts[value] = counts.get(value, 0) + local[value]
            else:
                values, freq = np.unique(following[following != SEPARATOR], return_counts=True)
                for value, count in zip(values.tolist(), freq.tolist()):
                    counts[value] = counts.get(value, 0) + count
        total = sum(counts.values())
        if not total:
            break
        if first_rank > 1 and not tokens:
            ranked = sorted(counts, key=counts.__getitem__, reverse=True)  # stable: ties as max breaks them
            if len(ranked) < first_rank:
                break
            best = ranked[first_rank - 1]
        else:
            best = max(counts, key=counts.__getitem__)
        chance *= counts[best] / total
        if chance < min_prob:
            break
        cautious *= counts[best] / (total + 1)
        score += cautious
        tokens.append(best)
        chances.append(chance)
        live = [(text, inside[following == best] + 1) for text, inside, following in nexts]
        live = [(text, after) for text, after in live if len(after)]
    return Continuation(tokens, chances, score)
