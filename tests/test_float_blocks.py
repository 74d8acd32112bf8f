"""A bfloat16 model on a CPU runs its bfloat16 weights on the block kernels: every row of a
product and of a verify is the same whatever the width, so speculative output equals the
model's own plain decoding under every policy (dtype = "bfloat16" parted from it at
near-ties on torch's kernels)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.config.model_spec import ModelSpec
from specdraft.core.sampling import SamplingParams
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, PlainDecoding, SuffixDrafter
from specdraft.drafters.layers import LayersDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.policies import POLICIES, build_policy
from specdraft.models.kernels.block_linear import BlockLinear, runs_on_file_quantization
from specdraft.models.cached_lm import CachedLM
from specdraft.models.float_blocks import FloatRowsEmbedding, to_float_blocks
from specdraft.models.loading import load_model
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.quantized_embedding import TiedEmbedding

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")

VOCAB = 96


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("columns, inputs", [(40, 64), (33, 70), (16, 576), (7, 3)])
def test_a_float_block_product_is_the_matrix_product_and_each_row_its_own(dtype, columns, inputs):
    generator = torch.Generator().manual_seed(columns)
    weight = torch.randn(columns, inputs, generator=generator).to(dtype)
    bias = torch.randn(columns, generator=generator)
    layer = BlockLinear.from_float(weight, bias)
    assert layer.bits == (16 if dtype == torch.bfloat16 else 32)
    assert torch.equal(layer.weight, weight.float())  # held exactly, in its own dtype
    x = torch.randn(13, inputs, generator=generator)
    wide = layer(x)
    reference = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(wide.double(), reference, rtol=1e-5, atol=1e-5 * inputs ** 0.5)
    for width in (1, 2, 3, 4, 7):  # rows in tiles of 3: every split of the tiles
        for first in range(0, 13 - width + 1, width):
            assert torch.equal(layer(x[first:first + width]), wide[first:first + width]), (width, first)


def bf16_tiny(seed: int = 0, layers: int = 3, tied: bool = False, sharpen: float = 4.0) -> LlamaForCausalLM:
    """A tiny llama loaded in bfloat16, moved onto the block kernels as load_model does."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model = model.to(torch.bfloat16)
    to_float_blocks(model)
    return model


def lean_plain_greedy(model, prompt: list[int], count: int) -> list[int]:
    """The model's own plain decoding: one token per step."""
    lm = CachedLM(model, lean=True)
    logits = lm.feed(torch.tensor(prompt))
    out = []
    for _ in range(count):
        out.append(int(logits[-1].argmax()))
        logits = lm.feed(torch.tensor(out[-1:]))
    return out


@pytest.fixture(scope="module")
def target():
    return bf16_tiny()


@pytest.mark.parametrize("tied", [False, True])
def test_every_matrix_keeps_its_bfloat16_weights_and_the_rest_runs_in_float32(tied):
    torch.manual_seed(0)
    reference_model = bf16_tiny(tied=tied, sharpen=1.0)
    blocks = [m for m in reference_model.modules() if isinstance(m, BlockLinear)]
    assert len(blocks) == 3 * 7 + 1 and all(m.bits == 16 for m in blocks)
    assert not [n for n, p in reference_model.named_parameters() if p.dtype != torch.float32]
    embedding = reference_model.model.embed_tokens
    assert isinstance(embedding, TiedEmbedding if tied else FloatRowsEmbedding)
    assert runs_on_file_quantization(reference_model)
    # The same numbers as the bfloat16 weights upcast to a float32 model, up to float32 rounding.
    torch.manual_seed(0)
    config = reference_model.config
    float_model = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": tied})).eval()
    float_model = float_model.to(torch.bfloat16).float()
    tokens = torch.arange(3, 40)
    expected = float_model(tokens[None]).logits[0]
    got = CachedLM(reference_model, lean=True).feed(tokens, keep=0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_verify_logits_equal_one_token_logits_bit_for_bit(target):
    tokens = torch.randint(3, VOCAB, (140,), generator=torch.Generator().manual_seed(4))
    steps = CachedLM(target, lean=True)
    one_by_one = torch.cat([steps.feed(tokens[i:i + 1]) for i in range(140)])
    block = CachedLM(target, lean=True)
    block.feed(tokens[:20])
    position = 20
    for width in (1, 2, 5, 11, 7, 3, 16, 9, 11, 4, 30):
        logits = block.feed(tokens[position:position + width], keep=0)
        assert torch.equal(logits, one_by_one[position:position + width]), f"width {width} at {position}"
        position += width


PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 12, 40, 41], [1, 70, 3, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_matches_plain_decoding_of_the_bfloat16_target(target, name):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target, lean=True)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), SuffixDrafter("suffix", ctx, SuffixOptions()),
                ModelDrafter("small", ctx, bf16_tiny(seed=1, layers=1)),
                ModelDrafter("twin", ctx, bf16_tiny(seed=0)),
                LayersDrafter("early", ctx, target_lm, 2), PlainDecoding(ctx)]
    options = {"drafter": "twin", "draft_length": "fixed"} if name == "fixed" else {"evaluate": "all"} \
        if POLICIES[name].FULL_INFORMATION else {}
    policy = build_policy(name, options, [d.name for d in drafters], seed=0, draft_tokens=6, horizon=48)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(6, 48, SamplingParams()))
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == lean_plain_greedy(target, prompt, 48)
        if name == "fixed":  # the twin's drafts are the target's own tokens: whole drafts accepted
            assert max(r.accepted for r in records) == 6


def test_load_model_runs_a_bfloat16_model_on_the_block_kernels_and_says_when_it_cannot(tmp_path, caplog):
    from tiny import save_tiny_pair

    folder = save_tiny_pair(tmp_path / "llama")
    spec = ModelSpec(path=folder, dtype="bfloat16")
    loaded = load_model(spec, "p.toml", "target")
    assert runs_on_file_quantization(loaded.model)
    assert {m.bits for m in loaded.model.modules() if isinstance(m, BlockLinear)} == {16}
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    loaded.tokenizer.save_pretrained(gpt2)
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        other = load_model(ModelSpec(path=gpt2, dtype="bfloat16"), "p.toml", "target")
    assert not runs_on_file_quantization(other.model)
    assert "runs in bfloat16 on torch's kernels" in caplog.text and "GPT2LMHeadModel" in caplog.text
