"""A drafter backed by a causal LM with its own KV cache: an independent small model
(`kind = "model"`), and the base of the `layers` self-drafter.

Drafting k tokens costs one catch-up forward over the committed tokens it has not seen
plus k - 1 single-token forwards; the last drafted token is never fed, because nothing
needs its successor's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specdraft.config.model_spec import MODEL_KEYS, ModelSpec, parse_model_spec
from specdraft.config.tables import Table
from specdraft.decoding.sampling import distributions, sample
from specdraft.decoding.verify import overlap
from specdraft.drafters.base import Draft, DraftContext, Drafter, PoolContext, TrajectoryScores
from specdraft.models.cached_lm import CachedLM


@dataclass(frozen=True)
class ModelOptions:
    model: ModelSpec


class ModelDrafter(Drafter):
    kind = "model"
    draft_alignment_is_score = True

    def __init__(self, name: str, ctx: DraftContext, model: torch.nn.Module):
        super().__init__(name, ctx)
        self.lm = CachedLM(model, logits_size=ctx.vocab_size)
        self._drafted_from = 0  # context length when the last draft started
        self._fed_drafts = 0  # drafted tokens that went into the cache

    @classmethod
    def parse_options(cls, table: Table, base: Path) -> ModelOptions:
        spec = parse_model_spec(table.subset(MODEL_KEYS), base)
        table.finish()
        return ModelOptions(spec)

    @classmethod
    def build(cls, name: str, options: ModelOptions, pool: PoolContext, key: str) -> "ModelDrafter":
        from specdraft.models.loading import check_tokenizers, load_model

        loaded = load_model(options.model, pool.file, key)
        check_tokenizers(pool.target, loaded, pool.file, key)
        ctx = pool.draft
        device = next(loaded.model.parameters()).device
        if device != ctx.device:  # each model samples with a generator on its own device
            index = int(key.partition("[")[2].rstrip("]") or 0)
            generator = torch.Generator(device=device).manual_seed(pool.seed + index + 1)
            ctx = DraftContext(ctx.params, generator, ctx.device, ctx.vocab_size)
        return cls(name, ctx, loaded.model)

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
            q = distributions(logits, params)
            token = logits.argmax(dim=-1) if params.greedy else sample(q, generator)  # [1]
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
        return overlap(target_probs, distributions(logits, self.ctx.params).to(target_probs.device))

    @property
    def causal_lm(self) -> torch.nn.Module:
        return self.lm.model

    @torch.inference_mode()
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        self.reset()
        n = len(context) - prompt_len
        logits = self.lm.uncached_logits(context)[prompt_len - 1 : prompt_len - 1 + n].to(target_probs.device)  # [n, V]
        alpha = overlap(target_probs, distributions(logits, self.ctx.params)).tolist()
        generated = torch.tensor(context[prompt_len:], device=target_probs.device)
        match = (logits.argmax(-1) == generated).tolist()
        runs = []
        for t in range(n):
            r = 0
            while r < k and t + r < n and match[t + r]:
                r += 1
            runs.append(r)
        return TrajectoryScores(alpha, [k] * n, runs, [alpha[t : t + k] for t in range(n)])
