"""The target on its GGUF file's own quantization: block codes read exactly, the block kernel
and the attention kernel width-invariant, and speculative output equal to specdraft's own
plain decoding of the quantized target under every policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, PlainDecoding, SuffixDrafter
from specdraft.drafters.layers import LayersDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.policies import POLICIES, build_policy
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.cached_lm import CachedLM
from specdraft.models.file_quantization import FileCodes, quantized_in_place
from specdraft.models.kernels.formats import Int8Codes, block_terms, int8_rows
from specdraft.models.kernels.native import causal_attention, kernel_problem, rms_norm, using_isa, vnni_available
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")

VOCAB = 96


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of a K-quant type with random codes and sane float16 scales."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scales = np.float16(rng.random((rows, cols // 256, 2)) * 0.01).view(np.uint8).reshape(rows, cols // 256, 4)
    where = (0, 4) if type_name != "Q6_K" else (208, 210)
    raw[..., where[0]:where[1]] = scales[..., : where[1] - where[0]]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_block_codes_reproduce_the_files_weights_exactly(type_name):
    rows, cols = 48, 512
    if type_name.endswith("_K"):
        data = _random_blocks(type_name, rows, cols)
    else:
        weight = (np.random.default_rng(1).standard_normal((rows, cols)) * 0.05).astype(np.float32)
        data = quantize(weight, GGMLQuantizationType[type_name])
    expected = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols)
    weights = block_terms(type_name, data, (rows, cols))
    np.testing.assert_array_equal(weights.dense().astype(np.float32), expected)
    if type_name == "Q8_0":
        assert isinstance(weights, Int8Codes)
    else:
        assert len(weights.codes) == (2 if type_name in ("Q5_0", "Q5_1", "Q5_K") else 1)


def test_formats_without_32_weight_groups_become_int8_rows():
    data = _random_blocks("Q6_K", 16, 512)
    expected = dequantize(data, GGMLQuantizationType.Q6_K).reshape(16, 512)
    codes = block_terms("Q6_K", data, (16, 512))
    assert isinstance(codes, Int8Codes) and np.all(codes.scales == codes.scales[:, :1])  # one scale a row
    step = np.abs(expected).max(axis=1, keepdims=True) / 127.0
    assert np.all(np.abs(codes.dense() - expected) <= step / 2 * (1 + 1e-5))  # the closest int8 row


def _block_linear(rows: int, cols: int, type_name: str = "Q4_1", seed: int = 0, bias: bool = False) -> tuple:
    weight = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    terms = block_terms(type_name, quantize(weight, GGMLQuantizationType[type_name]), (rows, cols))
    b = torch.randn(rows) if bias else None
    return BlockLinear.of(terms, b), torch.from_numpy(terms.dense()), b


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("columns", [96, 83])  # 83: the last block of 16 columns is partial
def test_the_block_kernel_multiplies_by_the_files_weights(type_name, columns):
    layer, dense, bias = _block_linear(columns, 256, type_name, bias=True)
    assert torch.equal(layer.weight, dense)  # the block layout reads back as the file's weights
    x = torch.randn(7, 256)
    expected = x.double() @ dense.t() + bias.double()
    got = layer(x).double()
    # activations are rounded to int8 per group of 32 (as llama.cpp does): about 1% of the scale
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("columns", [80, 71])
def test_each_row_of_a_wide_product_equals_its_one_row_product(type_name, columns):
    layer, _, _ = _block_linear(columns, 576, type_name, bias=True)
    x = torch.randn(17, 576) * 3
    wide = layer(x)
    for width in (2, 3, 5, 11, 17):
        torch.testing.assert_close(layer(x[:width]), wide[:width], rtol=0, atol=0)
    one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(17)])
    assert torch.equal(one_by_one, wide)


@pytest.mark.skipif(kernel_problem() is not None or not vnni_available(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("type_name, cols", [("Q4_1", 576), ("Q5_0", 576), ("Q8_0", 576), ("Q4_1", 544),
                                             ("Q8_0", 544)])
def test_the_vnni_kernels_give_the_avx2_kernels_products_bit_for_bit(type_name, cols):
    """544 columns are 17 groups: a group pair's odd half is empty at the end of each term."""
    layer, _, _ = _block_linear(72, cols, type_name, seed=3)
    x = torch.randn(9, cols) * 2
    x[3] = 0.0  # a row of zeros: every group scale 0
    x[4, :40] = 1e-30  # tiny values next to ordinary ones
    products = {}
    for isa in ("avx2", "vnni"):
        with using_isa(isa):
            products[isa] = [layer(x[:width]) for width in (1, 2, 3, 4, 5, 9)]
    for avx2, vnni in zip(products["avx2"], products["vnni"]):
        assert torch.equal(avx2, vnni)


def test_attention_rows_are_the_same_at_every_block_width_and_match_sdpa():
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity, start = 6, 2, 32, 160, 90
    keys, values = torch.randn(kv_heads, capacity, dim), torch.randn(kv_heads, capacity, dim)
    q = torch.randn(12, heads, dim)
    block = causal_attention(q, keys, values, start)
    for i in range(12):
        assert torch.equal(causal_attention(q[i:i + 1].contiguous(), keys, values, start + i)[0], block[i])
    mask = torch.ones(12, start + 12, dtype=torch.bool).tril(start)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, :start + 12],
                                          values[None, :, :start + 12], attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(block, sdpa[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_attention_over_many_row_tiles_gives_each_row_its_own_result(dim):
    # rows go in tiles that share key blocks (40 rows: three tiles, the last partial), and a
    # context past one value span: every row still equals its one-row block, chain and tree
    torch.manual_seed(1)
    heads, kv_heads, rows, start = 6, 3, 40, 150
    capacity = start + rows
    keys, values = torch.randn(kv_heads, capacity, dim), torch.randn(kv_heads, capacity, dim)
    q = torch.randn(rows, heads, dim)
    block = causal_attention(q, keys, values, start)
    for i in range(rows):
        assert torch.equal(causal_attention(q[i:i + 1].contiguous(), keys, values, start + i)[0], block[i])
    parents = torch.tensor([-1] + [max(0, i - 1 - (i % 3 == 0) * 2) for i in range(1, rows)], dtype=torch.int32)
    tree = causal_attention(q, keys, values, start, parents)
    for i in range(rows):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        slots = list(range(start)) + [start + row for row in reversed(path)]
        # as the last row of a chain that holds the row's path after the cached context
        chain_keys, chain_values = keys[:, slots].contiguous(), values[:, slots].contiguous()
        alone = causal_attention(q[i:i + 1].contiguous(), chain_keys, chain_values, len(slots) - 1)[0]
        assert torch.equal(alone, tree[i])
    mask = torch.ones(rows, capacity, dtype=torch.bool).tril(start)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                          enable_gqa=True)
    torch.testing.assert_close(block, sdpa[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rms_norm_rows_do_not_depend_on_each_other():
    x, weight = torch.randn(9, 1, 200), torch.randn(200)
    wide = rms_norm(x, weight, 1e-5)
    assert all(torch.equal(rms_norm(x[i:i + 1], weight, 1e-5), wide[i:i + 1]) for i in range(9))
    torch.testing.assert_close(wide, F.rms_norm(x, (200,), weight, 1e-5))


def quantized_tiny(seed: int = 0, layers: int = 3, sharpen: float = 4.0, heads: int = 4,
                   kv_heads: int = 2) -> LlamaForCausalLM:
    """A tiny llama on GGUF block codes (Q4_0 matrices, a Q8_0 embedding), as a file-quantized
    target loads."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    codes = FileCodes()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach().numpy()
            codes.matrices[name] = block_terms("Q4_0", quantize(weight, GGMLQuantizationType.Q4_0), weight.shape)
    table = model.model.embed_tokens.weight.detach().numpy()
    codes.embedding = ("Q8_0", quantize(table, GGMLQuantizationType.Q8_0).reshape(VOCAB, -1))
    return quantized_in_place(model, codes)


def lean_plain_greedy(model, prompt: list[int], count: int) -> list[int]:
    """specdraft's own plain decoding of the quantized target: one token per lean step."""
    lm = CachedLM(model, lean=True)
    logits = lm.feed(torch.tensor(prompt))
    out = []
    for _ in range(count):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = lm.feed(torch.tensor([token]))
    return out


@pytest.fixture(scope="module")
def qtarget():
    return quantized_tiny()


def test_a_quantized_embedding_looks_up_the_files_rows(qtarget):
    embedding = qtarget.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    expected = dequantize(embedding.blocks.numpy(), GGMLQuantizationType.Q8_0).reshape(VOCAB, -1)
    ids = torch.tensor([[5, 0, 95, 5]])
    np.testing.assert_array_equal(embedding(ids)[0].numpy(), expected[[5, 0, 95, 5]])


@pytest.mark.parametrize("narrow", [False, True])
def test_verify_logits_equal_one_token_logits_bit_for_bit(qtarget, narrow):
    """narrow: key and value projections of 8 columns, half a weight block: the lean forward
    runs them unfused."""
    if narrow:
        qtarget = quantized_tiny(seed=1, heads=8, kv_heads=1)
    tokens = torch.randint(3, VOCAB, (140,), generator=torch.Generator().manual_seed(4))
    steps = CachedLM(qtarget, lean=True)
    one_by_one = torch.cat([steps.feed(tokens[i:i + 1]) for i in range(140)])  # [140, V]
    block = CachedLM(qtarget, lean=True)
    block.feed(tokens[:20])
    position = 20
    for width in (1, 2, 5, 11, 7, 3, 16, 9, 11, 4, 30):  # verify blocks of every width, back to back
        logits = block.feed(tokens[position:position + width], keep=0)
        assert torch.equal(logits, one_by_one[position:position + width]), f"width {width} at {position}"
        position += width


def test_hidden_states_and_prefix_logits_come_from_the_same_buffer(qtarget):
    lm = CachedLM(qtarget, lean=True)
    tokens = torch.arange(3, 23)
    logits, hidden = lm.feed_with_hidden(tokens, keep=0, layers=(1, 3))
    assert set(hidden) == {1, 3} and hidden[1].shape == (20, 64)
    reference = qtarget(tokens[None], output_hidden_states=True)
    torch.testing.assert_close(hidden[1], reference.hidden_states[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, reference.logits[0], rtol=1e-3, atol=1e-3)
    prefix = lm.prefix_logits(torch.tensor([7, 8]), lm.length, 0, depth=2)
    assert prefix.shape == (2, VOCAB) and lm.length == 20  # the target's length is untouched


PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 12, 40, 41], [1, 70, 3, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("options", [{}, {"evaluate": "all"}])
def test_every_policy_matches_plain_decoding_of_the_quantized_target(qtarget, name, options):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(qtarget, lean=True)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), SuffixDrafter("suffix", ctx, SuffixOptions()),
                ModelDrafter("small", ctx, quantized_tiny(seed=1, layers=1)),
                LayersDrafter("early", ctx, target_lm, 2), PlainDecoding(ctx)]
    options = {"drafter": "lookup"} | options if name == "fixed" else options
    policy = build_policy(name, options, [d.name for d in drafters], seed=0, draft_tokens=6, horizon=48)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(6, 48, SamplingParams()))
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == lean_plain_greedy(qtarget, prompt, 48)


@pytest.mark.parametrize("drafter", ["lookup", "small", "early"])
def test_every_drafter_alone_matches_plain_decoding_of_the_quantized_target(qtarget, drafter):
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(qtarget, lean=True)
    drafters = {"lookup": NgramDrafter("lookup", ctx, 1, 3),
                "small": ModelDrafter("small", ctx, quantized_tiny(seed=0, layers=3)),  # the target's twin
                "early": LayersDrafter("early", ctx, target_lm, 2)}
    policy = build_policy("fixed", {"drafter": drafter, "draft_length": "fixed", "allow_none": False}, [drafter],
                          seed=0, draft_tokens=5, horizon=40)
    engine = SpeculativeEngine(target_lm, [drafters[drafter]], policy, EngineSettings(5, 40, SamplingParams()))
    records = list(engine.generate(PROMPTS[0]))
    assert [t for r in records for t in r.tokens] == lean_plain_greedy(qtarget, PROMPTS[0], 40)
    if drafter == "small":  # the twin drafts what the target says: whole drafts are accepted
        assert max(r.accepted for r in records) == 5


def test_int8_rows_fall_back_exactly_where_codes_cannot_be_read():
    weight = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    rows = int8_rows(weight)
    assert np.abs(rows.dense() - weight).max() <= np.abs(weight).max(axis=1).max() / 127.0


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_tied_embedding_reads_the_heads_rows_exactly(type_name):
    from specdraft.models.kernels.quantized_embedding import TiedEmbedding

    rows, cols = 45, 512  # the last block of 16 rows padded
    if type_name.endswith("_K"):
        data = _random_blocks(type_name, rows, cols, seed=7)
    else:
        weight = (np.random.default_rng(6).standard_normal((rows, cols)) * 0.1).astype(np.float32)
        data = quantize(weight, GGMLQuantizationType[type_name])
    terms = block_terms(type_name, data, (rows, cols))
    embedding = TiedEmbedding(BlockLinear.of(terms))
    ids = torch.tensor([[3, 44, 0, 3, 16, 31, 32]])
    np.testing.assert_array_equal(embedding(ids)[0].numpy(), _float32_rows(terms)[ids[0].numpy()])
    np.testing.assert_array_equal(embedding.weight.numpy(), _float32_rows(terms))


def _float32_rows(weights) -> np.ndarray:
    """The kernels' weights in float32 as they define them: code x scale (+ offset), each
    step rounded, a weight of several 4-bit terms summed over them in order from 0 (the
    file's exact value where there is one term)."""
    if isinstance(weights, Int8Codes):
        return weights.codes.astype(np.float32) * np.repeat(weights.scales.astype(np.float32), 32, axis=1)
    total = np.zeros(weights.shape, dtype=np.float32)
    for codes, scales, offsets in zip(weights.codes, weights.scales, weights.offsets):
        total += codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1) \
            + np.repeat(offsets.astype(np.float32), 32, axis=1)
    return total


def test_a_draft_head_over_the_quantized_target_keeps_plain_decoding(qtarget):
    from specdraft.drafters.head import HeadDrafter
    from tiny import random_head

    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    head = random_head(qtarget, list(range(0, VOCAB, 2)), lower_layers=(1,)).float()
    drafter = HeadDrafter("head", ctx, head, qtarget)
    policy = build_policy("fixed", {"drafter": "head", "draft_length": "fixed"}, ["head"], seed=0, draft_tokens=4,
                          horizon=40)
    engine = SpeculativeEngine(CachedLM(qtarget, lean=True), [drafter], policy, EngineSettings(4, 40, SamplingParams()))
    records = list(engine.generate(PROMPTS[0]))
    assert [t for r in records for t in r.tokens] == lean_plain_greedy(qtarget, PROMPTS[0], 40)
    assert sum(r.drafted for r in records) > 0


def test_the_architecture_is_read_from_the_header_alone(tmp_path):
    from gguf import GGUFWriter

    from specdraft.models.gguf.header import gguf_architecture

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    writer.add_uint32("qwen2.block_count", 2)
    writer.add_tensor("t", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == "qwen2"
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    assert gguf_architecture(tmp_path / "bad.gguf") is None
    assert gguf_architecture(tmp_path / "missing.gguf") is None


@pytest.mark.parametrize("value, expected", [("avx2", "avx2"), ("auto", None), ("sse", "SPECDRAFT_KERNEL_ISA=sse"),
                                             ("vnni", None), ("scalar", "scalar")])
def test_the_kernels_instruction_set_can_be_chosen_by_the_environment(value, expected):
    """A name that cannot run here is a usage error, never a silent fallback: unknown names,
    and vnni on a CPU without it."""
    import os
    import subprocess
    import sys

    code = ("from specdraft.errors import UsageError\n"
            "from specdraft.models.kernels.native import kernel_isa, kernel_problem, vnni_available\n"
            "try:\n    problem = kernel_problem()\nexcept UsageError as exc:\n    print(exc)\n    raise SystemExit\n"
            "print(problem if problem else f'{kernel_isa()} {int(vnni_available())}')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPECDRAFT_KERNEL_ISA": value})
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip()
    if value == "vnni":
        assert printed == "vnni 1" if vnni_available() else printed.startswith("SPECDRAFT_KERNEL_ISA=vnni: this CPU")
    elif expected is None:  # auto: VNNI exactly where the CPU has it
        chosen, available = printed.split()
        assert chosen == ("vnni" if available == "1" else "avx2")
    else:
        assert printed.startswith(expected)


@pytest.mark.parametrize("narrow", [False, True])
def test_whole_layers_in_one_c_call_give_the_layer_by_layer_logits_bit_for_bit(narrow):
    """The one-call path and the Python layer loop run the same kernels in the same order;
    narrow: key and value projections run side by side with the query's (three matrices)."""
    model = quantized_tiny(seed=2, heads=8, kv_heads=1) if narrow else quantized_tiny(seed=2)
    tokens = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(5))
    runs = []
    for in_c in (True, False):
        lm = CachedLM(model, lean=True)
        lm.lean.whole_layers_in_c = in_c
        logits = [lm.feed(tokens[:20])]
        position = 20
        for width in (1, 3, 7, 1, 11, 2):
            logits.append(lm.feed(tokens[position:position + width], keep=0))
            position += width
        hidden = lm.lean.forward(tokens[position:position + 4], position, 0, hidden_layers=(0, 1, 2))[1]
        runs.append((torch.cat(logits), hidden))
    assert model._specdraft_native_layers is not None  # the table was built: the C path ran
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys() == {0, 1, 2}
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in (0, 1, 2))
