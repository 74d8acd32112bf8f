"""Block scales kept as the file's float16 where exact: the same products as float32 scales,
on both instruction sets, and float32 wherever a scale or offset is not a float16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specdraft.models import block_linear
from specdraft.models.block_linear import BlockLinear, compact_scales, to_int8_blocks
from specdraft.models.gguf_blocks import block_terms
from specdraft.models.native import kernel_isa, kernel_problem, vnni_available

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


def _terms(type_name: str, rows: int, cols: int, seed: int = 0):
    weight = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    data = quantize(weight, GGMLQuantizationType[type_name])
    return block_terms(type_name, data, (rows, cols))


def _with_float32_scales(terms) -> BlockLinear:
    block_linear.HALF_SCALES = False
    try:
        return BlockLinear.of(terms)
    finally:
        block_linear.HALF_SCALES = True


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_files_scales_stay_float16_and_give_the_float32_scales_products_bit_for_bit(type_name):
    terms = _terms(type_name, 83, 544)  # a partial last block; 17 groups (an odd last pair)
    half, wide = BlockLinear.of(terms), _with_float32_scales(terms)
    assert half.half_scales and half.scales.dtype == torch.float16
    assert not wide.half_scales and wide.scales.dtype == torch.float32
    if half.bits == 4:
        assert half.offsets.dtype == torch.float16
    assert torch.equal(half.weight, wide.weight)  # the same weights read back
    x = torch.randn(11, 544) * 2
    x[3] = 0.0
    isas, before = ((0, 1) if vnni_available() else (0,)), kernel_isa(-1)
    try:
        for isa in isas:
            assert kernel_isa(isa) == isa
            for width in (1, 2, 5, 11):
                assert torch.equal(half(x[:width]), wide(x[:width])), (isa, width)
    finally:
        kernel_isa(before)


def test_scales_that_are_not_float16_stay_float32():
    scales = torch.full((16, 2), 0.25)
    offsets = torch.full((16, 2), -1.0)
    assert compact_scales(scales, offsets)[0].dtype == torch.float16
    scales[5, 1] = 1 / 3  # not a float16: the pair stays float32 together
    got = compact_scales(scales, offsets)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], scales)
    offsets[0, 0] = 1e6  # past float16's range
    assert compact_scales(torch.full((16, 2), 0.25), offsets)[0].dtype == torch.float32


def test_a_draft_heads_int8_scales_are_kept_as_float32_where_float16_would_round_them():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    torch.nn.init.normal_(layer[0].weight, std=0.1)
    to_int8_blocks(layer)
    moved = layer[0]
    assert isinstance(moved, BlockLinear) and moved.scales.dtype == torch.float32 and not moved.half_scales


def test_a_build_says_which_signatures_it_has_so_benchmarks_never_mix_two():
    import ctypes
    import ctypes.util

    from specdraft.models.native import interface_of, library

    assert interface_of(library()) == 3  # float16 scales (2), rows looked up in C (3)
    assert interface_of(ctypes.CDLL(ctypes.util.find_library("m"))) == 1  # a build from before the version


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("half", [True, False])
def test_rows_looked_up_in_c_are_the_tensor_formulas_floats(type_name, half):
    """A tied embedding's lookup: code x scale (+ offset), terms added, as the tensors do it."""
    terms = _terms(type_name, 83, 544, seed=2)
    layer = BlockLinear.of(terms) if half else _with_float32_scales(terms)
    ids = torch.tensor([0, 82, 17, 17, 64, 5])  # the partial last block, a repeat
    grouped, scales, offsets = layer._row_layout(ids)
    if layer.bits == 8:
        expected = (grouped.float() * scales[..., None]).view(len(ids), 544)
    else:
        codes = torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).float()
        expected = (codes * scales[..., None] + offsets[..., None]).view(len(ids), layer.terms, 544).sum(1)
    got = layer.rows(ids)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(layer.rows(ids[:1]), expected[:1])
    with pytest.raises(IndexError, match="0 .. 82"):
        layer.rows(torch.tensor([3, 83]))
