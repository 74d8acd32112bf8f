"""CachedLM: a causal language model together with its own KV cache and position.

Every model in a round (the target and each model-backed drafter) is one of these. It
knows how many tokens its cache holds, feeds new tokens at the right positions, and crops
back to a shorter length so that rejected draft tokens leave no trace.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch


class CachedLM:
    def __init__(self, model: torch.nn.Module, logits_size: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # Pad or cut this model's logits to the target's width so that p and q line up.
        self.logits_size = logits_size
        self.forward_seconds = 0.0  # host time spent in forwards, for overhead accounting
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache  # here, so that importing this module stays light

        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    def feed(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Consume `tokens` [n] and return the logits of the last `keep` positions [keep, V]
        (keep = 0 returns all n). Each row predicts the token after its position."""
        return self.feed_with_hidden(tokens, keep, ())[0]

    @torch.inference_mode()
    def feed_with_hidden(self, tokens: torch.Tensor, keep: int, layers: Sequence[int]
                         ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`feed`, also returning the hidden state after each of `layers` decoder layers at
        every position of `tokens` ({layer: [n, H]}, pre final norm): what drafters that
        read the target's internals are scored from."""
        start = time.perf_counter()
        n = tokens.shape[-1]
        positions = torch.arange(self.length, self.length + n, device=self.device)
        out = self.model(
            input_ids=tokens.view(1, n).to(self.device),
            position_ids=positions.view(1, n),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=bool(layers),
        )
        self.length += n
        logits = self._fit(out.logits[0])
        hidden = {layer: out.hidden_states[layer][0] for layer in layers}
        self.forward_seconds += time.perf_counter() - start
        return logits, hidden

    @torch.inference_mode()
    def uncached_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] at every position of `tokens` in one forward, leaving the cache alone."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        return self._fit(self.model(ids).logits[0])

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5 takes tokens to remove, negative
            self.length = length

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_logits(logits, self.logits_size)


def fit_logits(logits: torch.Tensor, size: int | None) -> torch.Tensor:
    """Pad (with -inf) or cut `logits` [..., V] to width `size` (None: unchanged)."""
    if size is None or logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
