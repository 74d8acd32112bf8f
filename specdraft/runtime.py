"""Building a ready-to-run speculative decoder from a validated profile.

Loads the target, builds each drafter of the pool (loading model drafters and checking
their tokenizers), the policy and the engine. Model-level checks that the profile parser
cannot do without the models raise ProfileError here, naming the drafter's key path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.cached_lm import CachedLM
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.decoding.sampling import SamplingParams
from specdraft.drafters import DraftContext, Drafter, ModelDrafter, NgramDrafter, PlainDecoding
from specdraft.drafters.layers import truncated_view
from specdraft.loading import LoadedModel, check_tokenizers, eos_token_ids, load_model
from specdraft.policies import build_policy, option_value
from specdraft.profile import PolicyConfig, Profile


@dataclass
class Runtime:
    profile: Profile
    target: LoadedModel
    engine: SpeculativeEngine
    drafters: list[Drafter]

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer


def sampling_params(profile: Profile) -> SamplingParams:
    d = profile.decode
    return SamplingParams(d.temperature, d.top_k, d.top_p)


def build_runtime(profile: Profile, target: LoadedModel | None = None, plain: bool = False) -> Runtime:
    """`target` may be passed in when the caller already loaded it (tests, bench).
    `plain=True` builds the baseline: the same engine with only the no-draft arm."""
    file = str(profile.file)
    target = target or load_model(profile.target, file, "target")
    target_lm = CachedLM(target.model)
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    seed = profile.decode.seed if profile.decode.seed is not None else random.randrange(2**63)
    generator = torch.Generator(device=target_lm.device).manual_seed(seed)
    ctx = DraftContext(sampling_params(profile), generator, target_lm.device, vocab_size)

    drafters: list[Drafter] = [PlainDecoding(ctx)] if plain else []
    for i, config in enumerate(() if plain else profile.drafters):
        key = f"drafters[{i}]"
        if config.kind == "ngram":
            drafters.append(NgramDrafter(config.name, ctx, config.min_ngram, config.max_ngram))
        elif config.kind == "layers":
            view = truncated_view(target.model, config.layers, (file, f"{key}.layers"))
            drafters.append(ModelDrafter(config.name, ctx, view, kind="layers"))
        else:
            loaded = load_model(config.model, file, key)
            check_tokenizers(target, loaded, file, key)
            drafter_ctx = ctx
            drafter_device = next(loaded.model.parameters()).device
            if drafter_device != target_lm.device:  # each model samples with a generator on its own device
                drafter_ctx = DraftContext(ctx.params, torch.Generator(device=drafter_device).manual_seed(seed + i + 1),
                                           ctx.device, vocab_size)
            drafters.append(ModelDrafter(config.name, drafter_ctx, loaded.model))

    policy_config = PolicyConfig("fixed") if plain else profile.policy
    if not plain and option_value(policy_config, "allow_none"):
        drafters.append(PlainDecoding(ctx))
    policy = build_policy(policy_config, [d.name for d in drafters], seed=seed,
                          draft_tokens=profile.decode.draft_tokens, horizon=profile.decode.max_new_tokens)
    settings = EngineSettings(
        draft_tokens=profile.decode.draft_tokens,
        max_new_tokens=profile.decode.max_new_tokens,
        sampling=ctx.params,
        eos_ids=eos_token_ids(target.model, target.tokenizer),
        reset_policy=option_value(policy_config, "reset") == "prompt",
        evaluate_all=option_value(policy_config, "evaluate") == "all",
    )
    engine = SpeculativeEngine(target_lm, drafters, policy, settings, generator)
    return Runtime(profile, target, engine, drafters)
