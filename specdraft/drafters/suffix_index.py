"""A token text indexed for "where else did the last m tokens occur?", for the suffix drafter.

`SuffixIndex` holds documents concatenated into one int32 array (each preceded by a -1
separator) and every position sorted by the text read *backwards* from it, up to `depth`
tokens: a suffix array of the reversed text, cut at a fixed depth. The context's last
token, then the one before, ... narrow a contiguous range of that order one token at a
time (the backward search of an FM-index), so finding the longest earlier occurrence of the
context's suffix costs O(match length x log N) token reads and does not grow with the store
beyond that logarithm. The positions in the final range are where the match ends; what
followed each of them is read forward from the text.

`ContextIndex` answers the same question for the current prompt and output, which grow
every round: the positions of each token and of each token pair are kept as the context
grows, so a lookup starts from the few places where the context's last two tokens occurred
and extends those backwards, one comparison per candidate and token.

Both return `Occurrences`: the matched length and the positions just after each occurrence
(capped, evenly spread over the range so frequent continuations stay frequent).

A lookup runs on the host in every round (and at every committed position when drafters are
scored), so it keeps to plain Python on short lists and to a few whole-array operations on long
ones: each numpy call costs about a microsecond however little it does, which a token-at-a-time
loop of them multiplies by the match length.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SEPARATOR = -1
MAX_OCCURRENCES = 256  # positions kept per source: enough to rank continuations
FEW_CANDIDATES = 32  # a range this small is narrowed to the end in plain Python
MEMO_LEVELS = 3  # narrowing steps whose ranges an index remembers ...
# ... up to this many ranges and wide ranges' occurrence lists (then it starts over: the
# index of a long-lived process's store stays within a few MB)
MEMO_RANGES, MEMO_SPREADS = 1 << 14, 1 << 10


@dataclass(frozen=True)
class Occurrences:
    length: int  # tokens matched (0: none)
    text: Sequence[int]  # the text the positions index (an int32 array, or the context's list)
    after: list[int]  # positions just past each occurrence (the next token's index), ascending
    end: int  # the text's visible length: a continuation stops there


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
        # The ranges of the first MEMO_LEVELS narrowing steps, by the tokens they matched:
        # those steps search the widest ranges, and contexts keep ending in the same tokens.
        # And a wide range's spread of occurrences (read-only lists, shared by the lookups).
        self._ranges: dict[tuple[int, ...], tuple[int, int]] = {}
        self._spread: dict[tuple[int, int], list[int]] = {}

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
            if hi - lo <= FEW_CANDIDATES and length:
                lo, hi, length = self._extend_all(lo, hi, length, context, limit)
                break
            token = int(context[len(context) - 1 - length])
            if length < MEMO_LEVELS:
                matched = tuple(int(t) for t in context[len(context) - 1 - length:])
                found = self._ranges.get(matched)
                if found is None:
                    found = _remembered(self._ranges, MEMO_RANGES, matched, self._narrow(lo, hi, length, token))
                new_lo, new_hi = found
            else:
                new_lo, new_hi = self._narrow(lo, hi, length, token)
            if new_hi <= new_lo:
                break
            lo, hi, length = new_lo, new_hi, length + 1
        if length == 0:
            return Occurrences(0, self.text, [], len(self.text))
        return Occurrences(length, self.text, self._after(lo, hi), len(self.text))

    def _after(self, lo: int, hi: int) -> list[int]:
        """The positions after the occurrences in [lo, hi) of the order (at most
        MAX_OCCURRENCES, evenly spread); a wide range's are remembered, like its bounds."""
        wide = hi - lo > FEW_CANDIDATES
        if wide and (lo, hi) in self._spread:
            return self._spread[lo, hi]
        ends = self.order[lo:hi] if hi - lo <= MAX_OCCURRENCES else \
            self.order[np.linspace(lo, hi - 1, MAX_OCCURRENCES).astype(np.int64)]
        after = (np.asarray(ends, dtype=np.int64) + 1).tolist()
        return _remembered(self._spread, MEMO_SPREADS, (lo, hi), after) if wide else after

    def _extend_all(self, lo: int, hi: int, length: int, context: Sequence[int], limit: int) -> tuple[int, int, int]:
        """The narrowing of [lo, hi) (matching `length` tokens) run to the end over its few
        candidates in plain Python, a token at a time, dropping those that part from the
        context. What is left is a contiguous run of the order (the candidates that share the
        longest prefix of the context read backwards), the range the narrowing ends in."""
        text, n = self.text, len(context)
        first, positions = lo, self.order[lo:hi].tolist()
        while length < limit:
            want = context[n - 1 - length]
            kept = [(i, p) for i, p in enumerate(positions) if p >= length and text.item(p - length) == want]
            if not kept:
                break
            first, positions, length = first + kept[0][0], [p for _, p in kept], length + 1
        return first, first + len(positions), length

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
        self.tokens: list[int] = []
        self.at: dict[int, list[int]] = {}  # token -> its positions, ascending
        self.pair_at: dict[int, list[int]] = {}  # (token before << 32 | token) -> the latter's positions

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with `context` (the committed tokens); a shorter one starts over."""
        n = len(context)
        if n < len(self.tokens):
            self.tokens, self.at, self.pair_at = [], {}, {}
        tokens, at, pair_at = self.tokens, self.at, self.pair_at
        for i in range(len(tokens), n):
            token = int(context[i])
            tokens.append(token)
            at.setdefault(token, []).append(i)
            if i:
                pair_at.setdefault(tokens[i - 1] << 32 | token, []).append(i)

    def longest_match(self, length: int, max_match: int) -> Occurrences:
        """The longest suffix of text[:length] that also occurs earlier in it."""
        text = self.tokens
        if length < 2 or max_match < 1:
            return Occurrences(0, text, [], length)
        last = text[length - 1]
        ends = _before(self.at.get(last, ()), length - 1)
        if not ends:
            return Occurrences(0, text, [], length)
        matched = 1
        if max_match > 1:
            paired = _before(self.pair_at.get(text[length - 2] << 32 | last, ()), length - 1)
            if paired:
                ends, matched = paired, 2
        while matched < max_match:
            want = text[length - 1 - matched]
            keep = [e for e in ends if e >= matched and text[e - matched] == want]
            if not keep:
                break
            ends, matched = keep, matched + 1
        # the latest occurrences (recent text predicts best)
        return Occurrences(matched, text, [e + 1 for e in ends[-MAX_OCCURRENCES:]], length)


def _remembered(memo: dict, limit: int, key, value):
    """memo[key] = value, the memo emptied first when it holds `limit`; returns value."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


def _before(positions: Sequence[int], end: int) -> list[int]:
    """The ascending `positions` below `end`."""
    return list(positions[:bisect_left(positions, end)]) if positions else []


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


def continue_occurrences(sources: Sequence[Occurrences], max_tokens: int, min_prob: float,
                         first_rank: int = 1) -> Continuation:
    """Follow the occurrences forward, most frequent next token first (SuffixDecoding's
    score): each step keeps the occurrences that continued with the chosen token, and the
    draft stops when the product of the chosen tokens' frequencies falls below min_prob.
    `first_rank` r > 1 starts from the r-th most frequent next token instead (nothing where
    fewer than r tokens followed), the way SuffixDecoding's tree holds other continuations."""
    live = [(s.text, s.end, s.after) for s in sources if s.after]
    tokens: list[int] = []
    chances: list[float] = []
    chance, cautious, score = 1.0, 1.0, 0.0
    while live and len(tokens) < max_tokens:
        counts: dict[int, int] = {}
        nexts = []
        for text, end, after in live:
            inside = [a for a in after if a < end]
            following = _read(text, inside)
            nexts.append((text, end, inside, following))
            local: dict[int, int] = {}
            for value in following:
                if value != SEPARATOR:
                    local[value] = local.get(value, 0) + 1
            for value in sorted(local):  # each source's tokens in ascending order: ties break the same way
                counts[value] = counts.get(value, 0) + local[value]
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
        live = [(text, end, [a + 1 for a, value in zip(inside, following) if value == best])
                for text, end, inside, following in nexts]
        live = [source for source in live if source[2]]
    return Continuation(tokens, chances, score)


def _read(text: Sequence[int], positions: list[int]) -> list[int]:
    """text[p] for each of `positions`, as Python ints (one gather from an array)."""
    if isinstance(text, np.ndarray):
        return text[positions].tolist() if positions else []
    return [text[p] for p in positions]
