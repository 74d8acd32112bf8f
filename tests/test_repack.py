"""The C repack (cpu_repack.c through models/gguf/repack.py): every format it reads gives, straight
from the file's bytes, the layer the Python block codes give (kernels/formats.py) bit for bit:
the same weights, the same scale values, the same products; with a row order, a partial last
block of columns, float32 scales where float16 cannot hold them, and formats it does not read
through the gguf package a slice at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.formats import block_terms
from specdraft.models.gguf.file import TYPES, TensorInfo
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.structs import ACTIVATIONS_OWN
from specdraft.models.gguf.repack import repacked
from specdraft.models.kernels.scale_forms import FACTORED, FLOAT16, FLOAT32, decoded

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")

SIZES = {name: (per_block, size) for name, per_block, size in TYPES.values()}
# where each format keeps its float16 scales in a block (kept small and finite in random blocks)
HALF_FIELDS = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q3_K": (108, 110), "Q2_K": (80, 84),
               "IQ4_NL": (0, 2), "IQ4_XS": (0, 2), "IQ3_S": (0, 2)}


def random_tensor(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [rows, bytes a row]: quantized from random weights where the gguf package
    quantizes the format, else random bytes with sane float16 scales."""
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        weight = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return quantize(weight, GGMLQuantizationType[type_name]).reshape(rows, -1)
    per_block, size = SIZES[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    start, end = HALF_FIELDS[type_name]
    halves = np.float16(rng.random((rows, cols // per_block, (end - start) // 2)) * 0.01)
    raw[..., start:end] = halves.view(np.uint8).reshape(rows, cols // per_block, end - start)
    return raw.reshape(rows, -1)


def info(type_name: str, rows: int, cols: int, data: np.ndarray) -> TensorInfo:
    return TensorInfo("blk.0.ffn_up.weight", type_name, (cols, rows), 0, data.nbytes)


def python_layer(type_name: str, data: np.ndarray, rows: int, cols: int, order=None) -> BlockLinear:
    codes = block_terms(type_name, data, (rows, cols))
    return BlockLinear.of(codes if order is None else codes.rows(order))


FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q2_K", "IQ4_NL", "IQ4_XS"]  # (Q6_K, Q3_K: below)


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("rows", [48, 37])  # 37: the last block of 16 columns is partial
def test_the_c_repack_gives_the_python_codes_layer_bit_for_bit(type_name, rows):
    cols = 512
    data = random_tensor(type_name, rows, cols)
    layer = repacked(info(type_name, rows, cols, data), data.reshape(-1))
    reference = python_layer(type_name, data, rows, cols)
    assert (layer.bits, layer.terms, layer.in_features, layer.out_features) == \
        (reference.bits, reference.terms, reference.in_features, reference.out_features)
    assert torch.equal(layer.weight, reference.weight)
    assert torch.equal(layer.codes, reference.codes)
    for name in ("scales", "offsets") if layer.bits == 4 else ("scales",):
        mine, theirs = decoded(getattr(layer, name)), decoded(getattr(reference, name))
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), name  # -0 is not 0
    x = torch.randn(5, cols)
    reference.activations = layer.activations  # (the file's format decides how activations round)
    assert torch.equal(layer(x), reference(x))
    if type_name == "Q2_K":  # int8 rows: the file's weights to half a step
        exact = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols).copy())
        step = exact.abs().amax(1, keepdim=True) / 127
        assert bool(((layer.weight - exact).abs() <= step / 2 * (1 + 1e-5)).all())
    else:
        expected = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols)
        assert torch.equal(layer.weight, torch.from_numpy(expected.copy()))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q5_K", "Q8_0", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_a_row_order_picks_the_files_rows(type_name):
    rows, cols = 32, 256
    data = random_tensor(type_name, rows, cols, seed=3)
    order = np.random.default_rng(4).permutation(rows)
    layer = repacked(info(type_name, rows, cols, data), data.reshape(-1), order)
    expected = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols)[order]
    assert torch.equal(layer.weight, torch.from_numpy(np.ascontiguousarray(expected)))


def test_scales_stay_in_the_smallest_exact_form_and_fall_back_to_float32():
    rows, cols = 16, 256
    for type_name, form in (("Q4_0", FLOAT16), ("Q8_0", FLOAT16), ("Q4_K", FACTORED), ("Q2_K", FLOAT32),
                            ("IQ4_NL", FLOAT16), ("IQ4_XS", FLOAT32)):
        data = random_tensor(type_name, rows, cols)
        assert repacked(info(type_name, rows, cols, data), data.reshape(-1)).scale_form == form, type_name
    data = random_tensor("Q5_0", rows, cols)
    blocks = data.reshape(rows, cols // 32, 22)
    blocks[0, 0, 0:2] = np.frombuffer(np.float16(30000.0).tobytes(), dtype=np.uint8)  # 16 d overflows float16
    layer = repacked(info("Q5_0", rows, cols, data), data.reshape(-1))
    assert layer.scale_form == FLOAT32 and torch.isfinite(layer.weight).all()
    assert torch.equal(layer.weight, python_layer("Q5_0", data, rows, cols).weight)


def test_formats_the_c_repack_does_not_read_become_int8_rows_a_slice_at_a_time(monkeypatch):
    import specdraft.models.gguf.repack as repack

    monkeypatch.setattr(repack, "_FALLBACK_ROWS", 7)  # several slices, the last one short
    rows, cols = 20, 256
    data = random_tensor("IQ3_S", rows, cols)
    layer = repacked(info("IQ3_S", rows, cols, data), data.reshape(-1))
    assert torch.equal(layer.weight, python_layer("IQ3_S", data, rows, cols).weight)


def test_a_tensor_shorter_than_its_shape_is_refused_not_read_past():
    rows, cols = 16, 256
    data = random_tensor("Q4_0", rows, cols).reshape(-1)[:-18]
    with pytest.raises(ValueError, match="cannot be repacked"):
        repacked(TensorInfo("w", "Q4_0", (cols, rows), 0, data.nbytes), data)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels quantize it (int8 per row and group of 32, amax / 127), back in
    float64: what each product's weights meet."""
    groups = x.view(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(groups * inverse).clamp(-127, 127)
    return (codes.double() * scale.double()).view_as(x)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K"])
@pytest.mark.parametrize("rows", [48, 37])
def test_six_bit_formats_keep_the_files_weights_exactly(type_name, rows):
    """Q6_K and Q3_K run on 6-bit codes with their per-16 scales (cpu_kernels_six.c): the
    layer's weights are the file's bit for bit, its products those weights times the
    quantized activations, each row the same at every width."""
    cols = 768
    data = random_tensor(type_name, rows, cols, seed=5)
    layer = repacked(info(type_name, rows, cols, data), data.reshape(-1))
    assert layer.bits == 6 and layer.in_features == cols and layer.out_features == rows
    expected = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols).copy())
    assert torch.equal(layer.weight, expected)
    size = {"Q6_K": 210, "Q3_K": 110}[type_name]
    held = layer.codes.numel() + layer.scales.numel()
    assert held <= -(-rows // 16) * 16 * cols // 256 * 210 and (type_name == "Q3_K" or held >= rows * cols // 256 * size)
    x = torch.randn(9, cols)
    layer.activations = ACTIVATIONS_OWN  # (the codes are checked here: the kernels' own groups of 32)
    wide = layer(x)
    reference = quantized_activations(x) @ expected.double().T
    assert torch.allclose(wide.double(), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    for m in range(9):
        assert torch.equal(layer(x[m:m + 1])[0], wide[m])


def test_six_bit_rows_keep_their_codes_in_a_subset_and_in_a_fused_layer():
    from specdraft.models.kernels.fused_linear import fuse

    cols = 256
    parts = [repacked(info("Q6_K", 32, cols, d), d.reshape(-1)) for d in
             (random_tensor("Q6_K", 32, cols, seed=s) for s in (6, 7))]
    ids = torch.tensor([5, 31, 0, 17, 16, 2, 9, 30, 11, 1, 3, 4, 6, 7, 8, 10, 12, 13])  # two blocks, the second partial
    subset = parts[0].subset(ids)
    assert subset.bits == 6 and torch.equal(subset.weight, parts[0].weight[ids])
    x = torch.randn(3, cols)
    assert torch.equal(subset(x), parts[0](x)[:, ids])
    expected = [p(x) for p in parts]
    fused = fuse(parts)
    assert isinstance(fused, BlockLinear) and fused.bits == 6
    assert torch.equal(fused(x), torch.cat(expected, dim=-1))


@pytest.mark.parametrize("width", [1, 2, 5, 11])
def test_six_bit_products_are_the_same_on_avx2_and_vnni(width):
    from specdraft.models.kernels.native import using_isa, vnni_available

    if not vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    rows, cols = 37, 512
    data = random_tensor("Q6_K", rows, cols, seed=8)
    layer = repacked(info("Q6_K", rows, cols, data), data.reshape(-1))
    x = torch.randn(width, cols)
    with using_isa("avx2"):
        avx2 = layer(x)
    with using_isa("vnni"):
        vnni = layer(x)
    assert torch.equal(avx2, vnni)
