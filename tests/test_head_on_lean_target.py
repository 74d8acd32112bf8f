"""A draft head over a target that runs specdraft's lean forward (the default on a CPU), on
its file's quantization or not: it is handed the features it was trained on (transformers'
hidden states, the last one after the final norm), its products run on the target's block
kernels where the target's do, and a new prompt does not dequantize the target's tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext
from specdraft.drafters.head import HeadDrafter
from specdraft.models.kernels.block_linear import BlockLinear, to_int8_blocks
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels.formats import GROUP, int8_groups
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding
from test_file_quantization import _block_linear, quantized_tiny
from tiny import VOCAB, random_head, tiny_llama

CONTEXT = [5, 9, 11, 3, 7, 5, 9, 12, 40]


@pytest.fixture(scope="module")
def qtarget():
    return quantized_tiny(seed=4)


def _context(vocab: int = VOCAB) -> DraftContext:
    return DraftContext(SamplingParams(), None, torch.device("cpu"), vocab)


def test_the_lean_forward_hands_over_every_hidden_state_transformers_does_the_last_after_the_norm():
    model = tiny_llama(layers=3)
    tokens = torch.tensor([3, 4, 9, 12, 7])
    with torch.no_grad():
        reference = model(tokens[None], output_hidden_states=True).hidden_states
    _, hidden = CachedLM(model, lean=True).feed_with_hidden(tokens, 0, (0, 1, 2, 3))
    for layer in range(4):
        torch.testing.assert_close(hidden[layer], reference[layer][0])
    # a token tree's rows: each the hidden states of its own path
    lm = CachedLM(model, lean=True)
    lm.feed(tokens[:2])
    _, tree = lm.feed_tree(torch.tensor([9, 12, 7]), [-1, 0, 0], (3,))
    with torch.no_grad():
        branch = model(torch.tensor([[3, 4, 9, 7]]), output_hidden_states=True).hidden_states[3][0, -1]
    torch.testing.assert_close(tree[3][:2], reference[3][0, 2:4])
    torch.testing.assert_close(tree[3][2], branch)


def test_the_quantized_targets_last_hidden_state_is_the_normed_one_too(qtarget):
    tokens = torch.arange(3, 23)
    _, hidden = CachedLM(qtarget, lean=True).feed_with_hidden(tokens, 0, (1, 3))
    with torch.no_grad():
        reference = qtarget(tokens[None], output_hidden_states=True).hidden_states
    for layer in (1, 3):
        torch.testing.assert_close(hidden[layer], reference[layer][0], rtol=1e-4, atol=1e-4)


def test_a_head_drafts_from_the_lean_target_what_it_drafts_from_transformers_forward():
    target = tiny_llama(seed=1, layers=3)
    drafts = []
    for lean in (True, False):
        drafter = HeadDrafter("head", _context(), random_head(target, lower_layers=(1,)), target)
        _, hidden = CachedLM(target, lean=lean).feed_with_hidden(torch.tensor(CONTEXT[:-1]), 1,
                                                                 drafter.feature_layers)
        drafter.observe_features(0, hidden)
        drafts.append(drafter.propose(CONTEXT, 4))
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    torch.testing.assert_close(drafts[0].probs, drafts[1].probs)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_subset_of_a_block_layer_keeps_its_rows_codes_to_the_bit(type_name, bias):
    layer, dense, _ = _block_linear(83, 256, type_name, bias=bias)
    ids = torch.tensor([0, 17, 82, 5, 16, 15, 40])
    subset = layer.subset(ids)
    assert subset.bits == layer.bits and subset.out_features == len(ids)
    assert torch.equal(subset.weight, layer.weight[ids])
    x = torch.randn(3, 256)
    assert torch.equal(subset(x), layer(x)[:, ids])  # each output column's sum is its own


def test_a_subset_of_float_blocks_keeps_their_dtype():
    layer = BlockLinear.from_float(torch.randn(40, 64).to(torch.bfloat16), torch.randn(40))
    ids = torch.tensor([39, 0, 16])
    subset = layer.subset(ids)
    assert subset.bits == 16 and torch.equal(subset.weight, layer.weight[ids])
    x = torch.randn(2, 64)
    assert torch.equal(subset(x), layer(x)[:, ids])


def test_int8_groups_round_each_group_against_its_own_scale():
    weight = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    weight[0, 3] = 100.0  # an outlier coarsens its own group only
    codes = int8_groups(weight)
    step = np.abs(weight.reshape(6, -1, GROUP)).max(axis=2) / 127.0
    error = np.abs(codes.dense() - weight).reshape(6, -1, GROUP)
    assert np.all(error <= step[..., None] / 2 * (1 + 1e-5))
    assert error[0, 1:].max() < 0.02  # the row's other groups keep a fine scale


def test_a_head_over_a_quantized_target_drafts_on_its_block_kernels(qtarget):
    vocab = list(range(0, qtarget.config.vocab_size, 2))
    head = random_head(qtarget, vocab, lower_layers=(1,)).float()
    dense = HeadDrafter("dense", _context(qtarget.config.vocab_size), random_head(qtarget, vocab, lower_layers=(1,)).float(), qtarget)
    dense.head_cache.readout.kernel = None  # the float32 readout, for reference
    drafter = HeadDrafter("head", _context(qtarget.config.vocab_size), head, qtarget)
    cache = drafter.head_cache
    layer = cache.head.body.layers[0]
    products = [cache.head.fc, cache.head.fuse, layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj]
    assert all(type(p) is BlockLinear and p.bits == 8 for p in products)
    assert torch.equal(cache.readout.kernel.weight, qtarget.lm_head.weight[torch.tensor(vocab)])
    assert not to_int8_blocks(cache.head)  # nothing float is left to move
    features = torch.randn(8, cache.feature_width)
    for d in (drafter, dense):
        d.head_cache.observe(0, features)
    # int8 weights with a scale per 32: the draft logits stay close to the float head's
    logits, reference = cache.consume(CONTEXT, 8, 7), dense.head_cache.consume(CONTEXT, 8, 7)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()


def test_a_new_prompt_does_not_dequantize_the_targets_tables(qtarget, monkeypatch):
    drafter = HeadDrafter("head", _context(qtarget.config.vocab_size),
                          random_head(qtarget, lower_layers=(1,)).float(), qtarget)

    def whole_table(self):
        raise AssertionError("the whole table was dequantized")

    monkeypatch.setattr(QuantizedEmbedding, "weight", property(whole_table))
    monkeypatch.setattr(BlockLinear, "weight", property(whole_table))
    for _ in range(2):
        drafter.reset()
        _, hidden = CachedLM(qtarget, lean=True).feed_with_hidden(torch.tensor(CONTEXT[:-1]), 1,
                                                                   drafter.feature_layers)
        drafter.observe_features(0, hidden)
        assert len(drafter.propose(CONTEXT, 3).tokens) == 3
