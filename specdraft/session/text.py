"""From committed token ids to streamed text: incremental detokenization and stop strings.

Decoding only a short window of recent tokens per round keeps the cost per round
constant; text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is held
back until the next token completes it. Stop strings are searched in the joined text, and
text that could still be the start of a stop string is held back so it is never printed
and then retracted.
"""

from __future__ import annotations

from typing import Any, Sequence


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # tokens before this are fully emitted and never re-decoded
        self.read_offset = 0  # tokens before this have had their text emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append token ids and return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        # Decoding a window that starts a few tokens back keeps word-boundary spacing right
        # for tokenizers that render a token differently at the start of a string.
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (e.g. a trailing partial character)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :] if after.startswith(before) else ""


class StopStringFilter:
    """Buffers text so that nothing at or after a stop string is ever emitted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; return what is safe to emit now. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        safe = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
