"""The `model` drafter kind: an independent causal LM sharing the target's tokenizer, over a
KV cache of its own. How it drafts, stops early and is scored is its base's
(`model_base.py`, `CausalLMDrafter`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdraft.drafters.base import DraftContext, PoolContext
from specdraft.drafters.model_base import CausalLMDrafter
from specdraft.drafters.options import ModelOptions
from specdraft.models.cached_lm import CachedLM


class ModelDrafter(CausalLMDrafter):
    kind = "model"
    traits = replace(CausalLMDrafter.traits, engine_problem="runs a model of its own beside the target (vLLM's "
                                                             "draft_model method runs one small model)")
    lm: CachedLM

    def __init__(self, name: str, ctx: DraftContext, model: torch.nn.Module, stop_below: float | None = None,
                 lm: CachedLM | None = None):
        """`lm`: the model with the cache it drafts over, when not a plain one of its own."""
        super().__init__(name, ctx, lm if lm is not None else CachedLM(model, logits_size=ctx.vocab_size), stop_below)

    @classmethod
    def build(cls, name: str, options: ModelOptions, pool: PoolContext, key: str, index: int) -> "ModelDrafter":
        from specdraft.models.loading import check_tokenizers

        loaded = pool.load(options.model, key)
        check_tokenizers(pool.target, loaded, pool.file, key)
        ctx = pool.draft
        device = next(loaded.model.parameters()).device
        if device != ctx.device:  # each model samples with a generator on its own device, seeded by its place
            generator = torch.Generator(device=device).manual_seed(pool.seed + index + 1)
            ctx = DraftContext(ctx.params, generator, ctx.device, ctx.vocab_size)
        return cls(name, ctx, loaded.model, options.stop_below, lm=pool.cached_lm(loaded.model))
