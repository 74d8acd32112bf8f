"""A GGUF tensor's own block codes and scales, rewritten as sums of 4-bit terms.

specdraft's block kernel (block_linear.py) multiplies by W[n, k] = c[n, k] * scale[n, g] +
offset[n, g] with 4-bit codes c (0..15) and one (scale, offset) per group g of 32 input
columns. Every GGUF format whose scales cover 32 weights or more maps onto a sum of such
terms exactly, with codes taken from the file's blocks, never requantized, and scales and
offsets that are exact float32 products of the file's float16 scales and small integers:

| format | per 32 weights in the file | terms | bytes per weight run |
|---|---|---|---|
| Q4_0 | d, 4-bit q: d (q - 8) | 1 | 0.5 + scales |
| Q4_1 | d, m, 4-bit q: d q + m | 1 | 0.5 + scales |
| Q4_K | super-block d, dmin, 6-bit sc, m: d sc q - dmin m | 1 | 0.5 + scales |
| Q5_0 / Q5_1 / Q5_K | as above with a fifth bit | 2 (low nibble, high bit) | 1 + scales |

A tensor with n terms runs as one kernel call over n x K input columns (the activations
repeated n times). Q8_0 keeps its int8 codes and block scales (`Int8Codes`, the kernel's
8-bit form: exact), and so do IQ4_NL and IQ4_XS, their 4-bit indices replaced by the int8
values of llama.cpp's non-linear table. Formats with scales per 16 weights (Q6_K, Q3_K, Q2_K;
the first two run exactly on the 6-bit layout, cpu_repack.c) and the others have neither form: they are dequantized by the `gguf` package and rounded to int8 per
output row (one scale per row), the closest layout the kernels take.

Codes are [N, K] rows in the order the file stores them; the caller permutes rows where
transformers does (llama's query and key projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # input columns sharing one scale in the 4-bit kernel (and one block of Q4_0/Q4_1/Q5_*/Q8_0)


@dataclass
class Int4Terms:
    """W = sum over terms t of codes[t] * scales[t] + offsets[t], group-wise."""

    codes: list[np.ndarray]  # each [N, K] uint8 in 0..15
    scales: list[np.ndarray]  # each [N, K / GROUP] float32
    offsets: list[np.ndarray]  # each [N, K / GROUP] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes[0].shape

    def dense(self) -> np.ndarray:
        """The weight [N, K] in float64 (for checks)."""
        total = np.zeros(self.shape, dtype=np.float64)
        for codes, scales, offsets in zip(self.codes, self.scales, self.offsets):
            total += codes.astype(np.float64) * np.repeat(scales.astype(np.float64), GROUP, axis=1) \
                + np.repeat(offsets.astype(np.float64), GROUP, axis=1)
        return total

    def rows(self, order: np.ndarray) -> "Int4Terms":
        return Int4Terms([c[order] for c in self.codes], [s[order] for s in self.scales],
                         [o[order] for o in self.offsets])


@dataclass
class Int8Codes:
    """W = codes * scales, one scale per group of 32 columns of a row (GGUF Q8_0's blocks, and
    the int8 rows that formats without 32-weight groups become)."""

    codes: np.ndarray  # [N, K] int8
    scales: np.ndarray  # [N, K / GROUP] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dense(self) -> np.ndarray:
        return self.codes.astype(np.float64) * np.repeat(self.scales.astype(np.float64), GROUP, axis=1)

    def rows(self, order: np.ndarray) -> "Int8Codes":
        return Int8Codes(self.codes[order], self.scales[order])


def has_terms(type_name: str, cols: int) -> bool:
    """Whether `block_terms` reads rows of `cols` of this format exactly (4-bit terms or int8
    groups), not as int8 rows."""
    return type_name in _DECODERS and cols % (256 if type_name.endswith(("_K", "_XS")) else GROUP) == 0


def block_terms(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> Int4Terms | Int8Codes | None:
    """The file's tensor `data` (raw blocks, uint8) of `shape` (rows, columns) as 4-bit terms
    or int8 groups (Q8_0), or as int8 rows for formats with neither form; None for float
    tensors."""
    rows, cols = shape
    if has_terms(type_name, cols):
        blocks = np.ascontiguousarray(data).reshape(rows, -1).view(np.uint8)
        return _DECODERS[type_name](blocks, rows, cols)
    if type_name in ("F32", "F16", "BF16", "F64"):
        return None
    return int8_rows(dequantized(type_name, data, shape))


def dequantized(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The tensor in float32 [rows, cols], by the `gguf` package's reference decoders."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32).reshape(shape)


def int8_rows(weight: np.ndarray) -> Int8Codes:
    """Symmetric int8 codes with one scale per row (repeated over the row's groups), rounded
    against the scale as the kernel reads it."""
    weight = weight.astype(np.float32)
    scales = (np.maximum(np.abs(weight).max(axis=1), 1e-12) / 127.0).astype(np.float32)
    codes = np.clip(np.rint(weight / scales[:, None]), -127, 127).astype(np.int8)
    return Int8Codes(codes, np.repeat(scales[:, None], weight.shape[1] // GROUP, axis=1))


def int8_groups(weight: np.ndarray) -> Int8Codes:
    """Symmetric int8 codes with one scale per group of 32 columns of a row (Q8_0's layout),
    rounded against the scale as the kernel reads it."""
    rows, cols = weight.shape
    grouped = weight.astype(np.float32).reshape(rows, cols // GROUP, GROUP)
    scales = (np.maximum(np.abs(grouped).max(axis=2), 1e-12) / 127.0).astype(np.float32)
    codes = np.clip(np.rint(grouped / scales[..., None]), -127, 127).astype(np.int8)
    return Int8Codes(codes.reshape(rows, cols), scales)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as float32 [rows, blocks]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_* order: weight j of a 32-block is byte j's low nibble, weight j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _split32(blocks: np.ndarray, rows: int, cols: int, size: int) -> np.ndarray:
    return blocks.reshape(rows, cols // GROUP, size)


def _q4_0(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = _split32(blocks, rows, cols, 18)
    d = _f16(b, 0)
    codes = _nibbles32(b[..., 2:18]).reshape(rows, cols)
    return Int4Terms([codes], [d], [-8.0 * d])


def _q4_1(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = _split32(blocks, rows, cols, 20)
    d, m = _f16(b, 0), _f16(b, 2)
    codes = _nibbles32(b[..., 4:20]).reshape(rows, cols)
    return Int4Terms([codes], [d], [m])


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the fifth bit of weight j is bit j of a little-endian uint32 ([..., 4] bytes -> [..., 32])."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = _split32(blocks, rows, cols, 22)
    d = _f16(b, 0)
    high = _high_bits32(b[..., 2:6]).reshape(rows, cols)
    low = _nibbles32(b[..., 6:22]).reshape(rows, cols)
    # d (low + 16 high - 16) = [low d - 16 d] + [high 16 d]
    return Int4Terms([low, high], [d, 16.0 * d], [-16.0 * d, np.zeros_like(d)])


def _q5_1(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = _split32(blocks, rows, cols, 24)
    d, m = _f16(b, 0), _f16(b, 2)
    high = _high_bits32(b[..., 4:8]).reshape(rows, cols)
    low = _nibbles32(b[..., 8:24]).reshape(rows, cols)
    return Int4Terms([low, high], [d, 16.0 * d], [m, np.zeros_like(d)])


def _q8_0(blocks: np.ndarray, rows: int, cols: int) -> Int8Codes:
    b = _split32(blocks, rows, cols, 34)
    return Int8Codes(b[..., 2:34].view(np.int8).reshape(rows, cols).copy(), _f16(b, 0))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 sub-blocks' 6-bit scales and mins from 12 bytes [..., 12] -> [..., 8] each."""
    s = packed.astype(np.uint16)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([low_sc, high_sc], -1).astype(np.float32),
            np.concatenate([low_m, high_m], -1).astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32-byte chunk holds sub-block 2c in its low nibbles, 2c + 1 in its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _k_header(b: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks [rows, blocks, bytes]: each sub-block's scale d sc and offset
    -dmin m, [rows, groups] each (w = q d sc - dmin m)."""
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, m = _k_scales(b[..., 4:16])
    return (d * sc).reshape(rows, -1), -(dmin * m).reshape(rows, -1)


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = blocks.reshape(rows, cols // 256, 144)
    scale, offset = _k_header(b, rows)
    return Int4Terms([_k_nibbles(b[..., 16:144]).reshape(rows, cols)], [scale], [offset])


def _q5_k(blocks: np.ndarray, rows: int, cols: int) -> Int4Terms:
    b = blocks.reshape(rows, cols // 256, 176)
    scale, offset = _k_header(b, rows)
    low = _k_nibbles(b[..., 48:176]).reshape(rows, cols)
    # qh[l] bit s is the fifth bit of weight l of sub-block s
    qh = b[..., 16:48]
    high = np.stack([(qh >> s) & 1 for s in range(8)], axis=-2).reshape(rows, cols)
    return Int4Terms([low, high], [scale, 16.0 * scale], [offset, np.zeros_like(scale)])


# the values IQ4_NL's and IQ4_XS's 4-bit indices stand for (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(blocks: np.ndarray, rows: int, cols: int) -> Int8Codes:
    b = _split32(blocks, rows, cols, 18)
    return Int8Codes(IQ4_VALUES[_nibbles32(b[..., 2:18])].reshape(rows, cols), _f16(b, 0))


def _iq4_xs(blocks: np.ndarray, rows: int, cols: int) -> Int8Codes:
    """Per 256: float16 d, a 6-bit ls per 32 (low bits in scales_l, top two in scales_h); the
    group's scale d (ls - 32) in float32, as llama.cpp computes it."""
    b = blocks.reshape(rows, cols // 256, 136)
    high = b[..., 2:4].copy().view(np.uint16).astype(np.int32)  # [rows, blocks, 1]
    low = b[..., 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((low[..., ib // 2] >> (4 * (ib % 2))) & 0x0F) | (((high >> (2 * ib)) & 3) << 4)
    scales = (_f16(b, 0)[..., None] * (ls - 32).astype(np.float32)).astype(np.float32).reshape(rows, -1)
    codes = IQ4_VALUES[_nibbles32(b[..., 8:136].reshape(rows, cols // 256, 8, 16))].reshape(rows, cols)
    return Int8Codes(codes, scales)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
             "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
EXACT_TYPES = frozenset(_DECODERS)  # read exactly; every other quantized type becomes int8 rows
