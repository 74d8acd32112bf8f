"""A policy with the driver that owns its round planner, and a tiny engine around one model
drafter: what tests/test_goodput.py and tests/test_early_stop.py plan and draft with."""

from __future__ import annotations

from specdraft.learning.driver import PolicyDriver
from specdraft.learning.policies import build_policy


def drive(name, options, arms, draft_tokens=5, **kwargs):
    """Policy `name` with the driver that owns its round planner."""
    policy = build_policy(name, options, arms, draft_tokens=draft_tokens, **kwargs)
    return PolicyDriver(policy, draft_tokens, 10_000)


def tiny_engine(drafter_options=None, k=4, max_new=30, **policy_options):
    """(target, its model drafter "small", an engine over both driven by `fixed`)."""
    import torch

    from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
    from specdraft.core.sampling import SamplingParams
    from specdraft.drafters import DraftContext, ModelDrafter
    from specdraft.models.cached_lm import CachedLM
    from tiny import VOCAB, tiny_llama

    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafter = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1), **(drafter_options or {}))
    policy = build_policy("fixed", {"drafter": "small"} | policy_options, ["small"], draft_tokens=k, horizon=max_new)
    return target, drafter, SpeculativeEngine(CachedLM(target), [drafter], policy,
                                              EngineSettings(k, max_new, SamplingParams()))
