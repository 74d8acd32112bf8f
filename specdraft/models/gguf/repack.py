"""A mapped GGUF tensor as a BlockLinear layer, repacked by C (cpu_repack.c) straight from
the file's bytes into the block products' layout: no float copy of the tensor, no Python per
block, the blocks spread over the threads.

Formats the C repack does not read (the IQ formats, Q8_1, ...) are dequantized by the `gguf`
package a slice of rows at a time and rounded to int8 rows (gguf_blocks.int8_rows), so even
they never need a float copy of the whole tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from specdraft.models.kernels.block_linear import BLOCK, SIX_GROUP_BYTES, SIX_SCALE_BYTES, BlockLinear
from specdraft.models.kernels.formats import GROUP, Int8Codes, dequantized, int8_rows
from specdraft.models.gguf.file import TYPES, TensorInfo
from specdraft.models.kernels.boundary import NOT_HALF, check_status
from specdraft.models.kernels.native import library
from specdraft.models.kernels.scale_forms import FACTORED, FLOAT16, FLOAT32
from specdraft.models.kernels.structs import ACTIVATIONS_OWN, ACTIVATIONS_Q8_0, ACTIVATIONS_Q8_1, ACTIVATIONS_Q8_K

TYPE_NUMBERS = {name: number for number, (name, _, _) in TYPES.items()}
_K_TYPES = ("Q4_K", "Q5_K")
_HALF_SCALED = ("Q8_0", "IQ4_NL")  # 8-bit codes whose scales are the file's float16 d
_FALLBACK_ROWS = 1024  # rows dequantized at once for a format the C repack does not read
# How llama.cpp quantizes the activations each format meets on a CPU (its type traits'
# vec_dot_type); the kernels round them the same way (cpu_common.c)
_ACTIVATIONS = {**dict.fromkeys(("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"), ACTIVATIONS_Q8_0),
                **dict.fromkeys(("Q4_1", "Q5_1"), ACTIVATIONS_Q8_1),
                **dict.fromkeys(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"), ACTIVATIONS_Q8_K)}


def repacked(info: TensorInfo, data: np.ndarray, order: np.ndarray | None = None,
             bias: torch.Tensor | None = None, threads: int | None = None) -> BlockLinear:
    """The quantized matrix `info` (raw bytes `data`, rows outermost) as a BlockLinear whose
    output column n is the file's row order[n] (all rows in order when None), meeting
    activations rounded as llama.cpp rounds them for the file's format."""
    layer = _repacked(info, data, order, bias, threads)
    layer.activations = _ACTIVATIONS.get(info.type_name, ACTIVATIONS_OWN)
    return layer


def _repacked(info: TensorInfo, data: np.ndarray, order: np.ndarray | None, bias: torch.Tensor | None,
              threads: int | None) -> BlockLinear:
    rows, cols = info.rows_cols
    bits = library().repack_bits(TYPE_NUMBERS[info.type_name])
    terms = library().repack_terms(TYPE_NUMBERS[info.type_name])
    if bits < 0 or cols % GROUP:
        return _rounded_rows(info, data, order, bias)
    natural = FACTORED if info.type_name in _K_TYPES else (FLOAT16 if bits == 4 or info.type_name in _HALF_SCALED
                                                           else FLOAT32)
    if not data.flags.c_contiguous:
        raise ValueError(f"repack_tensor: the bytes of {info.name} are not contiguous")
    for form in (natural, FLOAT32) if natural != FLOAT32 else (FLOAT32,):
        codes, scales, offsets = _buffers(rows, cols, bits, terms, form)
        status = library().repack_tensor(
            data.ctypes.data, data.nbytes, TYPE_NUMBERS[info.type_name], rows, cols,
            None if order is None else _checked_order(order, rows).ctypes.data, codes.data_ptr(), scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(), form, threads or torch.get_num_threads())
        if status == 0:
            return BlockLinear(codes, scales, offsets, max(terms, 1), bias, rows, bits=bits)
        if status != NOT_HALF:  # (float16 scales that cannot hold a value: float32 next)
            check_status("repack_tensor", status,
                         f"{info.name} ({info.type_name}, {rows} x {cols}) cannot be repacked: ")
    raise AssertionError("float32 scales hold any value")


def _checked_order(order: np.ndarray, rows: int) -> np.ndarray:
    order = np.ascontiguousarray(order, dtype=np.int64)
    if order.shape != (rows,):
        raise ValueError(f"a row order of {order.shape} for {rows} rows")
    return order


def _buffers(rows: int, cols: int, bits: int, terms: int, form: int) -> tuple:
    """(codes, scales, offsets) to repack into: empty, except that a partial last block of
    columns is written whole by the C side too (its missing columns as zeros)."""
    blocks = -(-rows // BLOCK)
    groups = cols // GROUP * max(terms, 1)
    if bits == 6:
        return (torch.empty(blocks, groups * SIX_GROUP_BYTES, dtype=torch.uint8),
                torch.empty(blocks, groups * SIX_SCALE_BYTES, dtype=torch.uint8), None)
    if bits == 8:
        codes = torch.empty(blocks, groups * 512, dtype=torch.int8)
        width = torch.float16 if form == FLOAT16 else torch.float32
        return codes, torch.empty(blocks, groups * BLOCK, dtype=width), None
    codes = torch.empty(blocks, groups * 256, dtype=torch.uint8)
    if form == FACTORED:
        return codes, *(torch.empty(blocks, groups * 20, dtype=torch.uint8) for _ in range(2))
    width = torch.float16 if form == FLOAT16 else torch.float32
    return codes, *(torch.empty(blocks, groups * BLOCK, dtype=width) for _ in range(2))


def _rounded_rows(info: TensorInfo, data: np.ndarray, order: np.ndarray | None,
                  bias: torch.Tensor | None) -> BlockLinear:
    """A format the C repack does not read: int8 rows, dequantized a slice of rows at a time."""
    rows, cols = info.rows_cols
    if cols % GROUP:
        raise ValueError(f"tensor {info.name} has {cols} columns, not a multiple of {GROUP}")
    per_row = info.nbytes // rows
    raw = data.reshape(rows, per_row)
    if order is not None:
        raw = raw[_checked_order(order, rows)]
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, cols // GROUP), dtype=np.float32)
    for start in range(0, rows, _FALLBACK_ROWS):
        chunk = raw[start:start + _FALLBACK_ROWS]
        rounded = int8_rows(dequantized(info.type_name, np.ascontiguousarray(chunk), (len(chunk), cols)))
        codes[start:start + len(chunk)], scales[start:start + len(chunk)] = rounded.codes, rounded.scales
    return BlockLinear.of(Int8Codes(codes, scales), bias)
