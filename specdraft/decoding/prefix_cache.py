"""Which token ids the target's cache holds after a prompt, so that the next prompt that
starts with them (a chat's next turn, a request sharing a system prompt) prefills only the
rest.

The record is taken when a prompt ends, with the target's reset count: anything that empties
the cache since (a cost probe) makes it void. Positions past the committed text (drafts
accepted after an EOS, or past the budget) are cropped away first. A prompt interrupted
mid-forward may leave the cache half written, so its caller forgets the record.
"""

from __future__ import annotations

from typing import Sequence

from specdraft.models.cached_lm import CachedLM


class PrefixCache:
    def __init__(self, target: CachedLM, enabled: bool):
        self.target = target
        self.enabled = enabled
        self.ids: list[int] = []
        self.at_reset = -1  # the target's reset count when `ids` was taken

    def take(self, context: Sequence[int]) -> int:
        """How many of the cached tokens `context` starts with (at most all but its last
        token, which the first verify feeds); the record is spent: until this prompt ends,
        the cache holds what its rounds leave."""
        ids, self.ids = self.ids, []
        if not self.enabled or self.target.resets != self.at_reset:
            return 0
        limit = min(len(ids), len(context) - 1, self.target.length)
        kept = 0
        while kept < limit and ids[kept] == context[kept]:
            kept += 1
        return kept

    def remember(self, context: Sequence[int]) -> None:
        """After a prompt: the cache holds `context`'s first tokens, up to its length."""
        length = min(self.target.length, len(context))
        self.target.crop(length)
        self.ids = list(context[:length])
        self.at_reset = self.target.resets

    def forget(self) -> None:
        self.ids = []
