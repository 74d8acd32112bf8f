"""The forms a block weight's scales and offsets take in memory (block_linear.py): the fewest
bytes that give the kernels the very same float32 numbers.

- `FLOAT32` (0): [NB, G * 16] float32, any value.
- `FLOAT16` (1): [NB, G * 16] float16, where every scale and offset is a float16 exactly (the
  file's own block scales: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
- `FACTORED` (2): 4-bit weights whose groups come in super-blocks of 8 (each term's K a
  multiple of 256), every value a float16 d of its super-block times a whole factor 0..255
  (a K-quant's d x 6-bit sc and dmin x 6-bit m, whose products mostly are not float16): per
  block of 16 columns one uint8 row of G * 16 factors (group-major, a lane per column), then
  G / 8 * 16 float16 d's, G * 20 bytes in all (cpu_kernels_shared.h). The kernels multiply
  factor by d in float32, which is exact (at most 11 + 8 significant bits), so they read the
  numbers the float32 form holds.

A weight's scales and offsets always share one form. Plain torch: no kernels.
"""

from __future__ import annotations

import torch

FLOAT32, FLOAT16, FACTORED = 0, 1, 2
BLOCK = 16  # columns per weight block (block_linear.BLOCK)
SUPER = 8  # groups per super-block of the factored form
MAX_FACTOR = 63  # the largest factor tried for a super-block's largest value (a K-quant's 6 bits)


def form_of(buffer: torch.Tensor) -> int:
    """The form a stored scales buffer is in (by its dtype)."""
    return {torch.float16: FLOAT16, torch.uint8: FACTORED}.get(buffer.dtype, FLOAT32)


def compact(scales: torch.Tensor, offsets: torch.Tensor | None, terms: int, narrow: bool = True) -> tuple:
    """(scales, offsets) of a weight in the block layout, [NB, G * 16] each (offsets None for
    8 bits), in the smallest form that holds exactly their values (`narrow` False: float32).
    Buffers already in a compact form are returned as they are (a fused weight's parts)."""
    both = [scales] if offsets is None else [scales, offsets]
    if len({form_of(t) for t in both}) == 1 and form_of(scales) != FLOAT32 and narrow:
        return scales.contiguous(), None if offsets is None else offsets.contiguous()
    wide = [decoded(t).contiguous() for t in both]
    if narrow:
        half = [t.to(torch.float16) for t in wide]
        if all(bool(_same_bits(h.float(), w).all()) for h, w in zip(half, wide)):
            return half[0], None if offsets is None else half[1]
        factored = [_factored(t, terms) for t in wide] if offsets is not None else [None]
        if all(f is not None for f in factored):
            return factored[0], factored[1]
    return wide[0], None if offsets is None else wide[1]


def decoded(buffer: torch.Tensor) -> torch.Tensor:
    """The float32 values [NB, G * 16] of a scales or offsets buffer in any form."""
    if form_of(buffer) != FACTORED:
        return buffer.float()
    blocks, groups = buffer.shape[0], buffer.shape[1] // (BLOCK + 2 * BLOCK // SUPER)
    factors = buffer[:, : groups * BLOCK].float().view(blocks, groups // SUPER, SUPER, BLOCK)
    supers = buffer[:, groups * BLOCK :].contiguous().view(torch.float16).float().view(blocks, groups // SUPER, 1, BLOCK)
    return (factors * supers).reshape(blocks, groups * BLOCK)


def _factored(values: torch.Tensor, terms: int) -> torch.Tensor | None:
    """`values` [NB, G * 16] float32 in the factored form, or None where some super-block
    (8 groups of one term, one column) is not a float16 times whole factors 0..255 bit for bit."""
    blocks, width = values.shape
    groups = width // BLOCK
    if width % BLOCK or groups == 0 or groups % terms or (groups // terms) % SUPER:
        return None
    cells = values.view(blocks, groups // SUPER, SUPER, BLOCK).transpose(2, 3).reshape(-1, SUPER)  # [NB S 16, 8]
    # The value of largest magnitude is d x its factor, the largest factor of a K-quant's
    # super-block: d is that value over a whole number up to 63 (exact division where it is).
    top = cells.gather(1, cells.abs().argmax(1, keepdim=True))  # [M, 1]
    # An all-zero super-block keeps d = +-0 and factors 0: -0 where its zeros are (a
    # K-quant's offsets -dmin x m are -0 where m is 0); its signs are checked with the rest.
    supers = torch.where(torch.signbit(top), -torch.zeros_like(top), torch.zeros_like(top))
    factors = torch.zeros_like(cells)
    left = (top != 0).squeeze(1).nonzero().squeeze(1)  # super-blocks not yet factored
    for k in range(MAX_FACTOR, 0, -1):  # (a K-quant's largest factor is mostly 63: one pass)
        if left.numel() == 0:
            break
        d, unresolved = top[left] / k, cells[left]
        whole = (unresolved / d).round()
        good = (d.to(torch.float16).float() == d).squeeze(1) \
            & ((whole >= 0) & (whole <= 255) & _same_bits(d * whole, unresolved)).all(1)
        done = left[good]
        supers[done], factors[done] = d[good], whole[good]
        left = left[~good]
    if left.numel() or not bool(_same_bits(supers * factors, cells).all()):
        return None
    factors = factors.view(blocks, groups // SUPER, BLOCK, SUPER)
    supers = supers.view(blocks, groups // SUPER, BLOCK)
    packed_factors = factors.transpose(2, 3).reshape(blocks, groups * BLOCK).to(torch.uint8)
    packed_supers = supers.to(torch.float16).reshape(blocks, -1).view(torch.uint8)
    return torch.cat([packed_factors, packed_supers], dim=1).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality of two float32 tensors (-0 is not 0, NaN never matches)."""
    return (a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)) & (a == a)
