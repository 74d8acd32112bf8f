"""Block scales in the fewest bytes that hold them exactly (scale_forms.py): the file's float16
where exact, a K-quant's factor x super-block d where that is, else float32; the same products
and rows as float32 scales on both instruction sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specdraft.models.kernels import block_linear
from specdraft.models.kernels.block_linear import BlockLinear, to_int8_blocks
from specdraft.models.kernels.formats import block_terms
from specdraft.models.kernels.native import kernel_problem, using_isa, vnni_available
from specdraft.models.kernels.scale_forms import FACTORED, FLOAT16, FLOAT32, compact, decoded

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


def _terms(type_name: str, rows: int, cols: int, seed: int = 0):
    if type_name.endswith("_K"):  # (gguf has no K-quant quantizer: random blocks, sane scales)
        from test_file_quantization import _random_blocks

        return block_terms(type_name, _random_blocks(type_name, rows, cols, seed), (rows, cols))
    weight = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    data = quantize(weight, GGMLQuantizationType[type_name])
    return block_terms(type_name, data, (rows, cols))


def _same_products(compacted: BlockLinear, wide: BlockLinear, inputs: int) -> None:
    x = torch.randn(11, inputs) * 2
    x[3] = 0.0
    for isa in ("scalar", "avx2", "vnni") if vnni_available() else ("scalar", "avx2"):
        with using_isa(isa):
            for width in (1, 2, 5, 11):
                assert torch.equal(compacted(x[:width]), wide(x[:width])), (isa, width)


def _with_float32_scales(terms) -> BlockLinear:
    block_linear.COMPACT_SCALES = False
    try:
        return BlockLinear.of(terms)
    finally:
        block_linear.COMPACT_SCALES = True


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_files_scales_stay_float16_and_give_the_float32_scales_products_bit_for_bit(type_name):
    terms = _terms(type_name, 83, 544)  # a partial last block; 17 groups (an odd last pair)
    half, wide = BlockLinear.of(terms), _with_float32_scales(terms)
    assert half.scale_form == FLOAT16 and half.scales.dtype == torch.float16
    assert wide.scale_form == FLOAT32 and wide.scales.dtype == torch.float32
    if half.bits == 4:
        assert half.offsets.dtype == torch.float16
    assert torch.equal(half.weight, wide.weight)  # the same weights read back
    _same_products(half, wide, 544)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quant_scales_are_factored_and_give_the_float32_scales_products_bit_for_bit(type_name):
    """d x sc and -dmin x m mostly are not float16, but they are a float16 d per super-block
    of 8 groups times a whole factor: 2.5 bytes a group of scale and offset instead of 8."""
    terms = _terms(type_name, 83, 512)  # a partial last block (its zero columns factor too)
    factored, wide = BlockLinear.of(terms), _with_float32_scales(terms)
    assert factored.scale_form == FACTORED and factored.scales.dtype == torch.uint8
    assert factored.scales.numel() + factored.offsets.numel() < (wide.scales.numel() + wide.offsets.numel()) * 4 / 3
    assert torch.equal(decoded(factored.scales), wide.scales) and torch.equal(decoded(factored.offsets), wide.offsets)
    assert torch.equal(factored.weight, wide.weight)
    _same_products(factored, wide, 512)


def test_a_super_block_that_does_not_factor_keeps_the_weight_float32():
    wide = _with_float32_scales(_terms("Q4_K", 16, 512))
    scales = wide.scales.clone()
    scales[0, 5] = 1 / 3  # no float16 d times a whole factor gives it
    got, _ = compact(scales, wide.offsets, 1)
    assert got.dtype == torch.float32 and torch.equal(got, scales)
    assert compact(wide.scales, wide.offsets, 1)[0].dtype == torch.uint8
    assert compact(wide.scales[:, :16 * 12], wide.offsets[:, :16 * 12], 1)[0].dtype == torch.float32  # 12 groups


def test_fused_factored_weights_run_as_one_and_mixed_forms_side_by_side():
    from specdraft.models.kernels.fused_linear import Concatenated, fuse

    parts = [BlockLinear.of(_terms("Q4_K", 32, 512, seed)) for seed in (1, 2)]
    x = torch.randn(3, 512)
    expected = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse(parts)
    assert isinstance(fused, BlockLinear) and fused.scale_form == FACTORED
    assert torch.equal(fused(x), expected) and torch.equal(parts[1](x), expected[:, 32:])
    mixed = [BlockLinear.of(_terms("Q4_K", 32, 512, 3)), BlockLinear.of(_terms("Q4_1", 32, 512, 4))]
    assert isinstance(fuse(mixed), Concatenated)


def test_scales_that_are_not_float16_stay_float32():
    scales = torch.full((16, 2), 0.25)
    offsets = torch.full((16, 2), -1.0)
    assert compact(scales, offsets, 1)[0].dtype == torch.float16
    scales[5, 1] = 1 / 3  # not a float16: the pair stays float32 together
    got = compact(scales, offsets, 1)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], scales)
    offsets[0, 0] = 1e6  # past float16's range
    assert compact(torch.full((16, 2), 0.25), offsets, 1)[0].dtype == torch.float32


def test_a_draft_heads_int8_scales_are_kept_as_float32_where_float16_would_round_them():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    torch.nn.init.normal_(layer[0].weight, std=0.1)
    to_int8_blocks(layer)
    moved = layer[0]
    assert isinstance(moved, BlockLinear) and moved.scales.dtype == torch.float32 and moved.scale_form == FLOAT32


def test_a_build_says_which_signatures_it_has_so_benchmarks_never_mix_two():
    import ctypes
    import ctypes.util

    from specdraft.models.kernels.native import interface_of, library

    assert interface_of(library()) == 10  # float16 scales (2), rows looked up in C (3), scale forms (4), 6-bit (5),
    # one library per instruction set with statuses (6), the QK norm (7), Gemma 3's layers (8), experts (9),
    # activations rounded per the file's format (10)
    assert interface_of(ctypes.CDLL(ctypes.util.find_library("m"))) == 1  # a build from before the version


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("compacted", [True, False])
def test_rows_looked_up_in_c_are_the_tensor_formulas_floats(type_name, compacted):
    """A tied embedding's lookup: code x scale (+ offset), terms added, as the tensors do it."""
    terms = _terms(type_name, 83, 544 if not type_name.endswith("_K") else 512, seed=2)
    layer = BlockLinear.of(terms) if compacted else _with_float32_scales(terms)
    assert (layer.scale_form != FLOAT32) == compacted
    ids = torch.tensor([0, 82, 17, 17, 64, 5])  # the partial last block, a repeat
    grouped, scales, offsets = layer._row_layout(ids)
    if layer.bits == 8:
        expected = (grouped.float() * scales[..., None]).view(len(ids), -1)
    else:
        codes = torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).float()
        expected = (codes * scales[..., None] + offsets[..., None]).view(len(ids), layer.terms, -1).sum(1)
    got = layer.rows(ids)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(layer.rows(ids[:1]), expected[:1])
    with pytest.raises(IndexError, match="0 .. 82"):
        layer.rows(torch.tensor([3, 83]))
