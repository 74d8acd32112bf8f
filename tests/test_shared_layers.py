"""The `layers` self-drafter over the target's own KV cache: no second cache, no catch-up
forward, the target's cache untouched for the verify, scores read from the verify's hidden
states, and greedy output still equal to plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter
from specdraft.drafters.layers import LayersDrafter, TargetPrefix, truncated_view
from specdraft.learning.policies import build_policy
from specdraft.models.cached_lm import CachedLM
from tiny import VOCAB, plain_greedy, tiny_llama

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [1, 40, 41, 42, 40, 41], [17]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


def engine_for(target, policy_name, params=SamplingParams(), k=4, max_new=32, **options):
    ctx = DraftContext(params, None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), LayersDrafter("shared", ctx, target_lm, 2),
                ModelDrafter("own", ctx, truncated_view(target, 2)), LayersDrafter("deep", ctx, target_lm, 3)]
    options = ({"drafter": "shared"} | options) if policy_name == "fixed" else options
    policy = build_policy(policy_name, options, [d.name for d in drafters], seed=0, draft_tokens=k, horizon=max_new)
    return SpeculativeEngine(target_lm, drafters, policy, EngineSettings(k, max_new, params)), drafters, target_lm


def cache_lengths(target_lm):
    return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in target_lm.cache.layers]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("policy, options", [("fixed", {"draft_length": "fixed"}), ("fixed", {}),
                                             ("random", {}), ("ucb", {}), ("normalhedge", {"update_every": 1}),
                                             ("normalhedge", {})])
def test_greedy_output_is_plain_greedy_and_the_target_cache_stays_whole(target, prompt, policy, options):
    engine, _, target_lm = engine_for(target, policy, **options)
    out = []
    for record in engine.generate(prompt):
        out.extend(record.tokens)
        if record.finish is None:  # every layer holds exactly the committed context but the last token
            assert cache_lengths(target_lm) == [len(prompt) + len(out) - 1] * 4
    assert out == plain_greedy(target, prompt, 32)


def test_the_layers_drafter_has_no_cache_of_its_own_and_never_catches_up(target, monkeypatch):
    engine, drafters, target_lm = engine_for(target, "fixed", draft_length="fixed")
    shared = drafters[1]
    assert isinstance(shared.lm, TargetPrefix) and shared.lm.target is target_lm
    widths = []
    original = type(shared.lm.model).forward

    def recording(self, *args, **kwargs):
        if self is shared.lm.model:
            widths.append(kwargs["input_ids"].shape[-1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(shared.lm.model), "forward", recording)
    records = list(engine.generate(PROMPTS[0]))
    assert widths and set(widths) == {1}  # one token per step: the committed context is already cached
    assert len(widths) == sum(r.drafted for r in records)  # k steps for k tokens, none to catch up


@pytest.mark.parametrize("params", [SamplingParams(soft_feedback=True), SamplingParams(0.9, top_k=20)])
def test_scores_from_the_verify_hidden_states_equal_the_views_own_forward(target, params):
    """'shared' (scored from the target's layer-2 hidden states) and 'own' (the same view
    with its own cache, scored by a catch-up forward) must agree at every position."""
    generator = torch.Generator().manual_seed(0)
    engine, _, _ = engine_for(target, "fixed", params=params, drafter="lookup", evaluate="all", update_every=1)
    engine.generator = generator
    for drafter in engine.drafters:
        drafter.ctx = DraftContext(params, generator, torch.device("cpu"), VOCAB)
    rounds = 0
    for record in engine.generate(PROMPTS[1]):
        for _, gammas in record.learning.evaluated or ():
            assert gammas[1] == pytest.approx(gammas[2], abs=1e-9)
            rounds += 1
    assert rounds > 3


def test_a_view_too_deep_is_a_value_error(target):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    with pytest.raises(ValueError, match="between 1 and 3"):
        LayersDrafter("too-deep", ctx, CachedLM(target), 4)
