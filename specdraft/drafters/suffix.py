"""The `suffix` drafter (SuffixDecoding, REST): continue the context the way text that
ended like it continued before, in this prompt, in earlier prompts of this process, in a
datastore built from files, or in what earlier runs generated (`learn = true`).

Each source finds the longest suffix of the context it holds (suffix_index.py); the
sources with the longest match vote with every occurrence on the next token, the most
frequent wins and the occurrences that did not continue with it drop out. The running
product of the winners' frequencies is the draft's confidence (SuffixDecoding's score):
drafting stops when it falls below `min_prob`, below the round's early-stop price, or
after `spec_factor` x the match length, so a long confident match drafts many tokens and a
weak one few or none. Drafting is on the host and deterministic (q one-hot), so
full-information scoring is free and acceptance stays lossless under sampling.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

from specdraft.drafters.base import DraftContext, PoolContext
from specdraft.drafters.datastore import StoreError, open_store, tokenizer_fingerprint
from specdraft.drafters.learned_store import LearnedStore
from specdraft.drafters.lookup_base import LookupDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.drafters.suffix_index import ContextIndex, Occurrences, SuffixIndex, continue_occurrences
from specdraft.errors import ProfileError

log = logging.getLogger("specdraft")


class ProcessHistory:
    """Earlier prompts and outputs, indexed in two levels so adding one stays cheap: a small
    recent index rebuilt per document, folded into the main one once it reaches a quarter of it
    (amortised O(log) rebuilds per token)."""

    def __init__(self, depth: int, documents: Sequence[Sequence[int]] = ()):
        self.depth = depth
        self.main: SuffixIndex | None = None
        self.main_docs: list[np.ndarray] = []
        self.recent: SuffixIndex | None = None
        self.recent_docs: list[np.ndarray] = []
        for document in documents:
            self.recent_docs.append(np.asarray(document, dtype=np.int32))
        self._rebuild()

    def add(self, document: Sequence[int]) -> None:
        self.recent_docs.append(np.asarray(document, dtype=np.int32))
        self._rebuild()

    @property
    def indexes(self) -> list[SuffixIndex]:
        return [i for i in (self.main, self.recent) if i is not None]

    def _rebuild(self) -> None:
        recent_size = sum(len(d) for d in self.recent_docs)
        if recent_size * 4 >= sum(len(d) for d in self.main_docs) and self.main_docs:
            self.main_docs += self.recent_docs
            self.recent_docs = []
            self.main = SuffixIndex.from_documents(self.main_docs, self.depth)
        elif not self.main_docs and self.recent_docs:
            self.main_docs, self.recent_docs = self.recent_docs, []
            self.main = SuffixIndex.from_documents(self.main_docs, self.depth)
        self.recent = SuffixIndex.from_documents(self.recent_docs, self.depth) if self.recent_docs else None


class SuffixDrafter(LookupDrafter):
    kind = "suffix"

    @classmethod
    def build(cls, name: str, options: SuffixOptions, pool: PoolContext, key: str, index: int) -> "SuffixDrafter":
        fingerprint = tokenizer_fingerprint(pool.target.tokenizer) if options.store or options.learn else ""
        store = None
        if options.store is not None:
            try:
                store = open_store(options.store, fingerprint, pool.draft.vocab_size)
            except StoreError as exc:
                raise ProfileError(pool.file, f"{key}.store", str(exc)) from None
        learned = None
        if options.learn:
            from specdraft.storage.cache_root import cache_dir

            learned = LearnedStore(cache_dir() / "suffix" / fingerprint[:16], fingerprint, options.max_match,
                                   options.learn_max_tokens, pool.draft.vocab_size)
        return cls(name, pool.draft, options, store=store, learned=learned, record=pool.record)

    def __init__(self, name: str, ctx: DraftContext, options: SuffixOptions, store: SuffixIndex | None = None,
                 learned: LearnedStore | None = None, record: bool = True):
        super().__init__(name, ctx)
        self.options = options
        self.reset()
        self.stores = [store] if store is not None else []
        self.learned = learned
        pending: list[np.ndarray] = []
        if learned is not None:
            try:
                base, pending = learned.open()
            except OSError as exc:  # an unwritable cache: draft without what earlier runs wrote
                log.warning("suffix drafter %s: learned store %s unusable (%s)", name, learned.root, exc)
                base, self.learned = None, None
            if base is not None:
                self.stores.append(base)
            if not record:  # read as it was at the start, written never
                self.learned = None
        self._loaded = pending  # learned text not yet compacted: history from before this run
        keep_history = options.history or learned is not None
        self.history = ProcessHistory(options.max_match, pending) if keep_history else None

    # --- the round -------------------------------------------------------------------

    def reset(self) -> None:
        self.context_index = ContextIndex()
        # The last lookup (position and the context's last max_match tokens there) and what
        # the sources found: a round asks about the same position up to three times (its
        # draft, then, when evaluated, whether the drafter was awake there and its score
        # there). Dropped when the history changes (end_prompt, forget_run).
        self._matched: tuple[tuple[int, tuple[int, ...]], list[list[Occurrences]]] | None = None

    def end_prompt(self, context: Sequence[int]) -> None:
        self._matched = None
        if self.history is not None and self.options.history:
            self.history.add(context)
        if self.learned is not None:
            try:
                self.learned.append(context)
            except OSError as exc:
                log.warning("suffix drafter %s: cannot record to %s (%s); learning stops for this run",
                            self.name, self.learned.root, exc)
                self.learned = None

    def forget_run(self) -> None:
        self._matched = None
        if self.history is not None:
            self.history = ProcessHistory(self.options.max_match, self._loaded)

    # --- matching ----------------------------------------------------------------------

    def lookup(self, context: Sequence[int], position: int, k: int, stop_price: float | None = None) -> list[int]:
        """Up to k tokens continuing context[:position]: each source's continuation of its
        longest match, the best-supported one wins (ties: the longer match, then the source
        closer to this prompt)."""
        if k <= 0 or position < 1:
            return []
        options = self.options
        floor = max(options.min_prob, stop_price or 0.0)
        best: tuple[float, int] | None = None
        tokens: list[int] = []
        for source in self._sources(context, position):
            length = source[0].length
            limit = min(k, max(1, math.floor(options.spec_factor * length)))
            draft = continue_occurrences(source, limit, floor, options.rank)
            rank = (draft.score, length)
            if draft.tokens and (best is None or rank > best):
                best, tokens = rank, draft.tokens
                self.last_match = length
        return tokens

    def _sources(self, context: Sequence[int], position: int) -> list[list[Occurrences]]:
        """Per source, the occurrences of its longest suffix of context[:position] (at least
        min_match long): this prompt, this run's history (its index levels merged), each store."""
        options = self.options
        window = context[max(0, position - options.max_match):position]
        key = (position, tuple(window))
        if self._matched is not None and self._matched[0] == key:
            return self._matched[1]
        groups: list[list[Occurrences]] = []
        if options.prompt:
            self.context_index.sync(context)
            groups.append([self.context_index.longest_match(position, options.max_match)])
        if self.history is not None:
            levels = [index.longest_match(window, options.max_match) for index in self.history.indexes]
            longest = max((o.length for o in levels), default=0)
            groups.append([o for o in levels if o.length == longest])
        groups += [[store.longest_match(window, options.max_match)] for store in self.stores]
        found = [g for g in groups if g and g[0].length >= options.min_match]
        self._matched = (key, found)
        return found
