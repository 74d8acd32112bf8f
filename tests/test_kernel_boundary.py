"""The kernels' safe boundary (cpu_boundary.c, models/kernels/boundary.py): a wrong shape,
dtype, device or layout at each Python entry is a ValueError naming the function, never a
crash; every exported C function refuses bad sizes with a status Python names; buffers C
writes are float32 whatever torch's default dtype; and a build whose structs differ from the
ctypes mirrors is refused when it loads."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_file_quantization import _block_linear, quantized_tiny

from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels import structs
from specdraft.models.kernels.boundary import check_layout, check_status
from specdraft.models.kernels.build import KernelBuildError
from specdraft.models.kernels.native import (add_rms_norm, attention_block, causal_attention, kernel_problem, library,
                                             rms_norm, swiglu)
from specdraft.models.kernels.native_layers import NativeLayers

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def _strided(*shape: int) -> torch.Tensor:
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def test_norms_and_swiglu_refuse_what_c_cannot_read():
    x, weight = torch.randn(3, 64), torch.ones(64)
    with pytest.raises(ValueError, match="rms_norm_rows: x is torch.float64, not torch.float32"):
        rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="rms_norm_rows: x is on meta, not the CPU"):
        rms_norm(_meta(3, 64), weight, 1e-6)
    with pytest.raises(ValueError, match="rms_norm_rows: x is not contiguous"):
        rms_norm(_strided(3, 64), weight, 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm_rows: weight has shape \(63,\), not \(64\)"):
        rms_norm(x, torch.ones(63), 1e-6)
    with pytest.raises(ValueError, match=r"add_rms_norm_rows: delta has shape \(3, 32\)"):
        add_rms_norm(x, torch.randn(3, 32), weight, 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm_rows: x is empty"):
        add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), weight, 1e-6)
    with pytest.raises(ValueError, match="swiglu_rows: gate_up's last dimension 7 is not even"):
        swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="swiglu_rows: gate_up is torch.bfloat16"):
        swiglu(torch.randn(2, 8, dtype=torch.bfloat16))


def test_attention_refuses_bad_tensors_head_sizes_heads_positions_and_trees():
    keys = values = torch.randn(2, 32, 64)
    q = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="causal_attention: q is on meta"):
        causal_attention(_meta(3, 4, 64), keys, values, 0)
    with pytest.raises(ValueError, match=r"causal_attention: values has shape \(2, 32, 32\)"):
        causal_attention(q, keys, torch.randn(2, 32, 32), 0)
    with pytest.raises(ValueError, match="causal_attention: keys is not contiguous"):
        causal_attention(q, keys.transpose(0, 1).contiguous().transpose(0, 1), values, 0)
    with pytest.raises(ValueError, match="causal_attention: the head size is not a multiple of 8 or is over 256"):
        causal_attention(torch.randn(1, 2, 264), torch.randn(1, 8, 264), torch.randn(1, 8, 264), 0)
    with pytest.raises(ValueError, match="head size is not a multiple of 8"):
        causal_attention(torch.randn(1, 2, 12), torch.randn(1, 8, 12), torch.randn(1, 8, 12), 0)
    with pytest.raises(ValueError, match="causal_attention: the query heads are not a multiple"):
        causal_attention(torch.randn(1, 3, 64), keys, values, 0)
    with pytest.raises(ValueError, match="causal_attention: start is negative, or start \\+ n is past"):
        causal_attention(q, keys, values, 30)
    with pytest.raises(ValueError, match="causal_attention: a token tree row's parent is not an earlier row"):
        causal_attention(q, keys, values, 0, torch.tensor([-1, 2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="causal_attention: parents is torch.int64, not torch.int32"):
        causal_attention(q, keys, values, 0, torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match=r"attention_block: cos has shape \(3, 32\)"):
        attention_block(torch.randn(3, 8 * 64), torch.randn(3, 32), torch.randn(3, 64), keys.clone(), values.clone(),
                        0, 4)
    with pytest.raises(ValueError, match=r"attention_block: qkv has shape \(3, 500\)"):
        attention_block(torch.randn(3, 500), torch.randn(3, 64), torch.randn(3, 64), keys.clone(), values.clone(), 0, 4)


def test_a_block_product_refuses_inputs_and_weights_c_cannot_read():
    layer, _, _ = _block_linear(40, 256, "Q4_1")
    with pytest.raises(ValueError, match=r"block_matmul: x has shape \(2, 128\), not \(\.\.\., 256\)"):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match="block_matmul: x is on meta, not the CPU"):
        layer(_meta(2, 256))
    assert layer(torch.empty(0, 256)).shape == (0, 40)  # no rows: nothing for C to do
    strided = _strided(3, 256)
    assert torch.equal(layer(strided), layer(strided.contiguous()))  # copied first, as before
    moved, _, _ = _block_linear(40, 256, "Q4_1")
    moved.codes = moved.codes.to("meta")
    with pytest.raises(ValueError, match="block_matmul: this BlockLinear's codes are on meta, not the CPU"):
        moved(torch.randn(1, 256))


def test_every_c_entry_checks_its_sizes_and_pointers():
    """Called directly, as a caller that skipped the Python checks would: a status, never a
    read or write past a buffer."""
    lib = library()
    x, y = torch.randn(2, 40), torch.empty(2, 16)
    codes, scales = torch.zeros(1, 2 * 512, dtype=torch.int8), torch.zeros(1, 2 * 16)
    assert lib.block_matmul(x.data_ptr(), 2, 40, codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 2, 0,
                            y.data_ptr(), 1) == -4  # K not a multiple of 32
    assert lib.block_matmul(x.data_ptr(), 2, 64, codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 3, 0,
                            y.data_ptr(), 1) == -5  # 3 groups for K / 32 = 2
    assert lib.block_matmul(x.data_ptr(), 2, 64, codes.data_ptr(), None, None, 0, 8, 16, 2, 0, y.data_ptr(),
                            1) == -2
    assert lib.block_matmul(x.data_ptr(), 0, 64, codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 2, 0,
                            y.data_ptr(), 1) == -3
    assert lib.block_matmul(x.data_ptr(), 2, 64, codes.data_ptr(), scales.data_ptr(), None, 2, 8, 16, 2, 0,
                            y.data_ptr(), 1) == -5  # no factored form for 8-bit codes
    assert lib.block_matmul(x.data_ptr(), 2, 64, codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 2, 4,
                            y.data_ptr(), 1) == -14  # no such way of rounding the activations
    assert lib.block_matmul(x.data_ptr(), 2, 64, codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 2, 3,
                            y.data_ptr(), 1) == -14  # Q8_K's super-blocks need K a multiple of 256
    assert lib.rms_norm_rows(x.data_ptr(), None, 2, 40, 1e-6, y.data_ptr()) == -2
    assert lib.swiglu_rows(x.data_ptr(), 2, 0, y.data_ptr()) == -3
    ids = torch.tensor([0, 20])
    assert lib.block_rows(codes.data_ptr(), scales.data_ptr(), None, 0, 8, 16, 2, 1, ids.data_ptr(), 2,
                          y.data_ptr()) == -10  # row 20 of 16
    q = torch.randn(1, 2, 64)
    assert lib.causal_attention(q.data_ptr(), q.data_ptr(), q.data_ptr(), 1, 0, 2, 1, 64, 1, 0.1, None, 0,
                                q.data_ptr(), 0) == -3  # no threads
    assert lib.causal_attention(q.data_ptr(), q.data_ptr(), q.data_ptr(), 1, 0, 2, 1, 64, 1, 0.1, None, -1,
                                q.data_ptr(), 1) == -3  # a negative window
    assert lib.geglu_rows(x.data_ptr(), 0, 20, y.data_ptr()) == -3
    with pytest.raises(ValueError, match="block_matmul: an input width is not a multiple of 32"):
        check_status("block_matmul", -4)
    with pytest.raises(MemoryError, match="decoder_layers: the kernel could not allocate"):
        check_status("decoder_layers", -1)


def test_the_decoder_layers_call_refuses_tables_and_buffers_that_do_not_fit():
    model = quantized_tiny(seed=1, layers=2)
    lm = CachedLM(model, lean=True)
    lm.feed(torch.arange(3, 9))
    table = model._specdraft_native_layers
    decoder = lm.lean
    x, cos, sin = torch.randn(1, 64), torch.ones(1, 16), torch.zeros(1, 16)
    with pytest.raises(ValueError, match="decoder_layers: x must be"):
        table.run(x, 6, 1, 2, decoder.heads, decoder.keys, decoder.values, cos, sin)  # layers 1..2 of 2
    with pytest.raises(ValueError, match=r"decoder_layers: cos has shape \(2, 16\)"):
        table.run(x, 6, 0, 2, decoder.heads, decoder.keys, decoder.values, torch.ones(2, 16), sin)
    with pytest.raises(ValueError, match="decoder_layers: start is negative, or start \\+ n is past"):
        table.run(x, decoder.capacity, 0, 2, decoder.heads, decoder.keys, decoder.values, cos, sin)
    broken = NativeLayers((structs.Layer * 2)())  # norms and matrices left NULL
    with pytest.raises(ValueError, match="decoder_layers: a pointer it reads or writes is NULL"):
        broken.run(x, 6, 0, 2, decoder.heads, decoder.keys, decoder.values, cos, sin)
    table.table[1].qkv[0].N -= 16  # the query/key/value widths no longer fit the heads
    try:
        with pytest.raises(ValueError, match="decoder_layers: a layer's projection widths do not fit"):
            table.run(x, 6, 0, 2, decoder.heads, decoder.keys, decoder.values, cos, sin)
    finally:
        table.table[1].qkv[0].N += 16


def test_products_are_float32_whatever_torchs_default_dtype():
    layer, _, bias = _block_linear(40, 256, "Q8_0", bias=True)
    x = torch.randn(3, 256)
    expected = layer(x)
    rows = layer.rows(torch.tensor([1, 7]))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.equal(layer(x), expected)  # float32 in, float32 out
        assert torch.equal(layer(x.double()), expected.double())  # float64 in: computed in float32, returned as given
        assert torch.equal(layer.rows(torch.tensor([1, 7])), rows)
        gate_up = torch.randn(2, 8, dtype=torch.float32)
        assert swiglu(gate_up).dtype == torch.float32
        keys = torch.randn(1, 8, 8, dtype=torch.float32)
        out = attention_block(torch.randn(1, 24, dtype=torch.float32), torch.ones(1, 8, dtype=torch.float32),
                              torch.zeros(1, 8, dtype=torch.float32), keys, keys.clone(), 0, 1)
        assert out.dtype == torch.float32
    finally:
        torch.set_default_dtype(before)


def _mirror(name: str, fields: list) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def test_a_build_whose_structs_differ_from_the_mirrors_is_refused(monkeypatch):
    check_layout(library())  # (the build and the mirrors agree)
    matrix, layer = structs.Matrix._fields_, structs.Layer._fields_
    wrong = {
        "Matrix": _mirror("Matrix", matrix[:5] + [matrix[6], matrix[5], matrix[7]]),  # groups and bits swapped
        "Layer": _mirror("Layer", [field for field in layer if field[0] != "eps2"]),  # a field missing
    }
    for name, mirror in wrong.items():
        with monkeypatch.context() as patch:
            patch.setattr(structs, name, mirror)
            with pytest.raises(KernelBuildError, match="struct layout .* differ from the ctypes mirrors"):
                check_layout(library())
    narrow = _mirror("Matrix", matrix[:7] + [("form", ctypes.c_short)])  # same offsets, another size
    for name, value in (("Matrix", narrow), ("MAX_HEAD_DIM", 512)):  # ... and a constant the two sides share
        with monkeypatch.context() as patch:
            patch.setattr(structs, name, value)
            with pytest.raises(KernelBuildError, match="differ from the ctypes mirrors"):
                check_layout(library())


def test_a_repack_refuses_bytes_it_cannot_read():
    from test_repack import info, random_tensor

    from specdraft.models.gguf.repack import repacked

    data = random_tensor("Q4_0", 16, 256)
    strided = np.lib.stride_tricks.as_strided(data, shape=(data.size // 2,), strides=(2,))
    with pytest.raises(ValueError, match="repack_tensor: the bytes of .* are not contiguous"):
        repacked(info("Q4_0", 8, 256, data), strided)
