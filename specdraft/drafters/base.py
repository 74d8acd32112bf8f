"""The one interface every drafter kind implements, so the round never branches on kind.

A drafter sees the committed context (token ids), proposes up to k tokens with the
distributions it drew them from, and is told afterwards how many were accepted so it can
roll its own state back. A deterministic drafter returns `probs=None` (one-hot q).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from specdraft.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] long, on the target's device; k may be smaller than asked, even 0
    probs: torch.Tensor | None  # [k, V] q_j, or None for a deterministic (one-hot) drafter


@dataclass(frozen=True)
class DraftContext:
    """What every drafter of one run shares: sampling rules, randomness, where the target lives."""

    params: SamplingParams
    generator: torch.Generator | None
    device: torch.device
    vocab_size: int  # width of the target's logits


class Drafter(ABC):
    kind: str = ""
    # True when the alignment of its draft at a position equals what `score` gives there
    # (autoregressive models: q depends only on the context). A prompt-lookup draft is one
    # lookup's whole span, so its per-position score is a fresh lookup instead.
    draft_alignment_is_score: bool = False

    def __init__(self, name: str, ctx: DraftContext):
        self.name = name
        self.ctx = ctx

    def reset(self) -> None:
        """Forget the previous prompt."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Propose up to k tokens continuing `context` (all committed tokens, prompt included)."""

    def on_commit(self, n_accepted: int) -> None:
        """After a round this drafter drafted: `n_accepted` of its tokens were kept."""

    @abstractmethod
    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor) -> torch.Tensor:
        """Full-information evaluation: gamma at committed positions start .. start+count-1 [count],
        i.e. sum_v min(p, q) with this drafter's q given context[:position]; `target_probs`
        [count, V] are the target's distributions there. Leaves the drafter caught up to
        context[:start + count - 1]."""

    def empty_draft(self) -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=self.ctx.device), None)


class PlainDecoding(Drafter):
    """The `none` arm: drafts nothing, so the round is one plain target step."""

    kind = "none"

    def __init__(self, ctx: DraftContext, name: str = "none"):
        super().__init__(name, ctx)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return self.empty_draft()

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor) -> torch.Tensor:
        return target_probs.new_zeros(count)  # proposes nothing, so nothing is ever accepted
