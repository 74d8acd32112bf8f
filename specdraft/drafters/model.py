"""A drafter backed by a causal LM with its own KV cache: an independent small model
(`kind = "model"`) or a view of the target's first layers (`kind = "layers"`).

Drafting k tokens costs one catch-up forward over the committed tokens it has not seen
plus k - 1 single-token forwards; the last drafted token is never fed, because nothing
needs its successor's distribution.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.cached_lm import CachedLM
from specdraft.decoding.sampling import plain_probs, sample, sampling_probs
from specdraft.drafters.base import Draft, DraftContext, Drafter


class ModelDrafter(Drafter):
    kind = "model"
    draft_alignment_is_score = True

    def __init__(self, name: str, ctx: DraftContext, model: torch.nn.Module, kind: str = "model"):
        super().__init__(name, ctx)
        self.kind = kind  # "model", or "layers" for a view of the target
        self.lm = CachedLM(model, logits_size=ctx.vocab_size)
        self._drafted_from = 0  # context length when the last draft started
        self._fed_drafts = 0  # drafted tokens that went into the cache

    def reset(self) -> None:
        self.lm.reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return self.empty_draft()
        if self.lm.length >= len(context):  # cannot happen in a round; recover rather than mis-draft
            self.lm.crop(len(context) - 1)
        unseen = torch.tensor(context[self.lm.length:], dtype=torch.long, device=self.lm.device)
        logits = self.lm.feed(unseen, keep=1)  # [1, V]
        tokens, probs = [], []
        params, generator = self.ctx.params, self.ctx.generator
        for j in range(k):
            if params.greedy:
                token = logits.argmax(dim=-1)  # [1]
                q = plain_probs(logits)  # temperature 1: only for alignment feedback
            else:
                q = sampling_probs(logits, params)
                token = sample(q, generator)
            tokens.append(token)
            probs.append(q)
            if j < k - 1:
                logits = self.lm.feed(token, keep=1)
        self._drafted_from, self._fed_drafts = len(context), k - 1
        return Draft(torch.cat(tokens).to(self.ctx.device), torch.cat(probs).to(self.ctx.device))

    def on_commit(self, n_accepted: int) -> None:
        # Keep the committed context plus the accepted drafts it already consumed.
        self.lm.crop(self._drafted_from + min(n_accepted, self._fed_drafts))

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor) -> torch.Tensor:
        if self.lm.length > start - 1:  # those positions' logits are gone: recompute them
            self.lm.crop(start - 1)
        unseen = torch.tensor(context[self.lm.length : start + count - 1], dtype=torch.long, device=self.lm.device)
        logits = self.lm.feed(unseen, keep=count)  # [count, V]
        params = self.ctx.params
        q = plain_probs(logits) if params.greedy else sampling_probs(logits, params)
        return torch.minimum(target_probs, q.to(target_probs.device, target_probs.dtype)).sum(dim=-1)
