"""Building a ready-to-run speculative decoder from a validated profile.

Loads the target, has the drafter registry build the pool, and builds the policy and the
engine. Model-level checks that the profile parser cannot do without the models raise
ProfileError while the pool is built, naming the drafter's key path.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdraft.profile import PolicyConfig, Profile
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.penalty import RepeatPenalty
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, Drafter, PlainDecoding, PoolContext
from specdraft.drafters.registry import build_pool
from specdraft.errors import ProfileError
from specdraft.learning.policies import build_policy
from specdraft.models.kernels.block_linear import runs_on_file_quantization
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import LoadedModel, eos_token_ids, load_model
from specdraft.models.kv_cache import core_choice
from specdraft.models.lean.support import lean_problem
from specdraft.models.kernels.packed_linear import pack_linears, packing_choice
from specdraft.models.width_costs import width_costs

log = logging.getLogger("specdraft")


@dataclass
class Runtime:
    profile: Profile
    target: LoadedModel
    engine: SpeculativeEngine
    drafters: list[Drafter]
    models: dict = field(default_factory=dict)  # drafters' loaded models by spec, for runtimes built beside this one

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer


def sampling_params(profile: Profile) -> SamplingParams:
    d = profile.decode
    return SamplingParams(d.temperature, d.top_k, d.top_p, soft_feedback=d.feedback == "soft")


def engine_settings(profile: Profile, target: LoadedModel, params: SamplingParams) -> EngineSettings:
    decode = profile.decode
    return EngineSettings(decode.draft_tokens, decode.max_new_tokens, params, eos_token_ids(target.model, target.tokenizer),
                          RepeatPenalty(decode.repeat_penalty, decode.repeat_last_n))


def build_runtime(profile: Profile, target: LoadedModel | None = None, plain: bool = False,
                  models: dict | None = None, keep_dense: bool = False, warn_absent: bool = True,
                  record: bool = True) -> Runtime:
    """`target` may be passed in when the caller already loaded it (tests, bench), and
    `models` (another runtime's `.models`) to share the drafters' weights with it.
    `plain=True` (or a pool of no drafters) builds the baseline: the engine with only the no-draft arm.
    `keep_dense`: a target whose linear layers get packed keeps its dense weights too, so
    that transformers' own generation can run on the stock kernels (packed_linear.py).
    `warn_absent=False`: an optional drafter left out is not warned about again.
    `record=False`: drafters read what earlier runs taught them but write nothing (bench,
    trace: a measurement must not teach the next one)."""
    file = str(profile.file)
    plain = plain or not profile.drafters
    models = {} if models is None else models
    target = target or load_model(profile.target, file, "target")
    decode = profile.decode
    if packing_choice(decode.linear_kernel, target.model):  # once per model: later runtimes share it
        began = time.perf_counter()
        count = pack_linears(target.model, keep_dense=keep_dense)
        log.info("packed the target's %d linear layers for oneDNN in %.1f s", count, time.perf_counter() - began)
    static, graphs = core_choice(decode.kv_cache, decode.cuda_graphs, next(target.model.parameters()).device)
    # A target on its file's quantization runs the lean forward, whose products and attention
    # give each row of a verify what a one-token step gives (block_linear.py, native.py).
    lean = runs_on_file_quantization(target.model) and lean_problem(target.model) is None
    target_lm = CachedLM(target.model, static=static and not lean, graphs=graphs and not lean, lean=lean)
    vocab_size = int(target.model.get_output_embeddings().out_features)  # a quantized head has no .weight
    seed = profile.decode.seed if profile.decode.seed is not None else random.randrange(2**63)
    generator = torch.Generator(device=target_lm.device).manual_seed(seed)
    ctx = DraftContext(sampling_params(profile), generator, target_lm.device, vocab_size)

    policy_config = PolicyConfig("fixed") if plain else profile.policy
    drafters, absent = ([PlainDecoding(ctx)], {}) if plain else build_pool(
        profile.drafters, PoolContext(ctx, target, target_lm, file, seed, models, decode.kv_cache, decode.cuda_graphs,
                                         decode.drafter_core, record), warn_absent)
    chosen = policy_config.options.get("drafter") if policy_config.name == "fixed" else None
    if chosen in absent:
        raise ProfileError(file, "policy.drafter", f'the fixed policy drafts with "{chosen}", which is not '
                                                   f"available: {absent[chosen]}")
    if not plain:  # in the order of the profile's arms; the plain arm: a plain round when nothing pays off
        by_name = {d.name: d for d in drafters}
        drafters = [by_name[name] if name in by_name else PlainDecoding(ctx) for name in profile.arms
                    if name in by_name or name not in absent]
    policy = build_policy(policy_config.name, policy_config.options, [d.name for d in drafters], seed=seed,
                          draft_tokens=profile.decode.draft_tokens, horizon=profile.decode.max_new_tokens)
    engine = SpeculativeEngine(target_lm, drafters, policy, engine_settings(profile, target, ctx.params), generator)
    if not plain and decode.verify_costs == "measure":
        # From disk, else measured now (once per model shape and machine): the planner's
        # verify costs by width.
        engine.driver.planner.costs.verify.install(width_costs(target_lm, decode.draft_tokens + 1))
    return Runtime(profile, target, engine, drafters, models)
