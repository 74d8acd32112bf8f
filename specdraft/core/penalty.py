"""The repetition penalty, applied to the target's logits row by row inside the verify.

A token that occurs among the last `last_n` tokens of the context has its logit divided by
the penalty when positive and multiplied by it otherwise (llama.cpp's `--repeat-penalty`,
whose window also covers the prompt). What "the context" is differs per row of a verify:
row j of a chain was computed after the committed text plus the first j drafted tokens,
and a tree's row after its own path. Penalising each row by its own window gives every row
exactly the distribution plain decoding with the penalty would have there, so greedy and
sampled acceptance stay lossless relative to the penalised target. The drafters see their
own unpenalised distributions: only the target's rule decides what is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

WHOLE_CONTEXT = -1  # last_n meaning every token of the context


@dataclass(frozen=True)
class RepeatPenalty:
    factor: float = 1.0  # 1.0: off
    last_n: int = 64  # tokens of the context the window covers; WHOLE_CONTEXT; 0: off

    @property
    def active(self) -> bool:
        return self.factor != 1.0 and self.last_n != 0

    def tail(self, context: Sequence[int]) -> list[int]:
        """The part of `context` any row's window can reach."""
        return list(context) if self.last_n == WHOLE_CONTEXT else list(context[max(0, len(context) - self.last_n):])

    def chain(self, logits: torch.Tensor, context: Sequence[int], draft: torch.Tensor) -> torch.Tensor:
        """`logits` [k + 1, V] of a chain verify over [context[-1], draft] penalised
        row by row: row j's window ends with the first j drafted tokens."""
        k, vocab = draft.shape[0], logits.shape[-1]
        tail = self.tail(context)
        span = len(tail) + k if self.last_n == WHOLE_CONTEXT else self.last_n
        # Left padding with the out-of-vocabulary id `vocab` lets one unfold give every
        # row its window, however short the context (that column is dropped below).
        sequence = torch.cat([torch.full((span - len(tail),), vocab, dtype=torch.long, device=draft.device),
                              torch.tensor(tail, dtype=torch.long, device=draft.device), draft.long()])
        return self.apply(logits, sequence.unfold(0, span, 1))  # [k + 1, span]: row j ends before draft[j]

    def rows(self, logits: torch.Tensor, context: Sequence[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """`logits` [len(paths), V], row r computed after `context` + `paths[r]` (a token
        tree's rows: each path the drafted tokens from the root down to that row)."""
        vocab = logits.shape[-1]
        tail = self.tail(context)
        windows = [tail + list(path) for path in paths]
        span = max(len(w) for w in windows) if self.last_n == WHOLE_CONTEXT else self.last_n
        padded = [w[len(w) - span:] if len(w) > span else [vocab] * (span - len(w)) + w for w in windows]
        return self.apply(logits, torch.tensor(padded, dtype=torch.long, device=logits.device).view(len(paths), span))

    def apply(self, logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """`logits` [n, V] with the tokens of `windows` [n, W] (ids; `V` is padding) penalised per row."""
        n, vocab = logits.shape
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, windows.to(logits.device), True)
        penalised = torch.where(logits > 0, logits / self.factor, logits * self.factor)
        return torch.where(seen[:, :vocab], penalised, logits)
