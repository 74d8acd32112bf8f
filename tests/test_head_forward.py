"""A head's forward on a CPU: packed with its packed target, and the lean forward over its
own KV buffer, each drafting what transformers' forward does."""

from __future__ import annotations

import pytest
import torch

from heads import PROMPTS, engine_for
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext
from specdraft.drafters.head import HeadDrafter
from tiny import VOCAB, plain_greedy, random_head, tiny_llama


def test_a_head_drafting_for_a_packed_target_is_packed_and_drafts_the_same():
    """A head follows its target onto oneDNN's packed kernels (layer and readout), with the
    same draft logits up to float rounding, and output stays plain greedy decoding."""
    from specdraft.models.kernels.packed_linear import PackedLinear, pack_linears

    target = tiny_llama(seed=0, layers=3).float()
    packed_target = tiny_llama(seed=0, layers=3).float()
    pack_linears(packed_target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    dense = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2))).float(), target)
    packed = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2))).float(), packed_target)
    assert not any(isinstance(m, PackedLinear) for m in dense.head_cache.head.modules())
    assert isinstance(packed.head_cache.head.fc, PackedLinear) and packed.head_cache.readout.kernel is not None
    features = torch.randn(6, target.config.hidden_size)
    for drafter in (dense, packed):
        drafter.head_cache.observe(0, features)
    context = [5, 9, 11, 3, 7, 5, 9]
    torch.testing.assert_close(packed.head_cache.consume(context, 6, 5), dense.head_cache.consume(context, 6, 5),
                               rtol=1e-4, atol=1e-4)
    token = torch.tensor(4)
    torch.testing.assert_close(packed.head_cache.step(token), dense.head_cache.step(token), rtol=1e-4, atol=1e-4)
    for prompt in PROMPTS:
        engine, _ = engine_for(packed_target, random_head(target).float(), "fixed")
        assert [t for r in engine.generate(prompt) for t in r.tokens] == plain_greedy(target, prompt, 32)


@pytest.mark.parametrize("packed_target", [False, True])
def test_the_lean_head_forward_drafts_what_transformers_forward_does(packed_target):
    """On a CPU a head's layer runs the lean forward over its own KV buffer (packed where the
    target is); its logits match transformers' one-layer forward with a DynamicCache, through
    catch-up feeds, drafted steps and rollbacks, with fused lower layers too."""
    from specdraft.models.kernels.packed_linear import pack_linears

    target = tiny_llama(seed=0, layers=3).float()
    if packed_target:
        pack_linears(target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    head = random_head(target, list(range(0, VOCAB, 2)), lower_layers=(1,)).float()
    slow = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2)), lower_layers=(1,)).float(), target,
                       core="transformers")
    lean = HeadDrafter("head", ctx, head, target)
    assert slow.head_cache.lean is None and lean.head_cache.lean is not None
    features = torch.randn(12, 2 * target.config.hidden_size)
    context = [5, 9, 11, 3, 7, 5, 9, 2, 8, 4, 6, 1, 3]
    for drafter in (slow, lean):
        drafter.head_cache.observe(0, features)

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    caches = slow.head_cache, lean.head_cache
    close(*(c.consume(context, 6, 5) for c in caches))
    for token in (4, 10, 2):
        close(*(c.step(torch.tensor(token)) for c in caches))
    for cache in caches:  # the drafts are rejected: back to the committed pairs, then more of them
        cache.crop(6)
    close(*(c.consume(context, 11, 5) for c in caches))
    close(*(c.step(torch.tensor(7)) for c in caches))
    for cache in caches:  # a new prompt
        cache.reset()
        cache.observe(0, features.flip(0))
    close(*(c.consume(context[::-1], 9, 8) for c in caches))

