"""Selecting output rows of a 6-bit weight (GGUF's Q6_K and Q3_K as the file holds them,
cpu_kernels_shared.h SIX_*) without touching their codes: a draft head's readout over part of
its target's vocabulary keeps the very same weights.

A group of a block of 16 columns is 96 cells of four bytes, six of them each column's: four
of low nibbles (cell 16 k + c) and two of top bits (cell 64 + 16 h + 8 p + lane for column
c = 8 h + lane, part p). Rows are gathered cell by cell into a new layout.
"""

from __future__ import annotations

import torch

BLOCK = 16
CELLS = 96  # four-byte cells in one group of one block
SUPER = 8  # groups per float16 d


def _cell_positions() -> torch.Tensor:
    """[16, 6]: the cells of each column of a block."""
    rows = []
    for c in range(BLOCK):
        rows.append([16 * k + c for k in range(4)] + [64 + 16 * (c // 8) + 8 * p + c % 8 for p in range(2)])
    return torch.tensor(rows)


POSITIONS = _cell_positions()


def subset_six(codes: torch.Tensor, scales: torch.Tensor, groups: int, ids: torch.Tensor) -> tuple:
    """(codes, scales) of a 6-bit weight [NB, G * 384] / [NB, G * 36] (uint8) holding only the
    output rows `ids` [n], in that order (a partial last block padded with zero columns)."""
    ids = ids.to("cpu", torch.int64)
    blocks, lanes = ids // BLOCK, ids % BLOCK
    n = len(ids)
    new_blocks = -(-n // BLOCK)
    group_index = torch.arange(groups)
    cells = codes.view(codes.shape[0], groups, CELLS, 4)
    picked = cells[blocks[:, None, None], group_index[None, :, None], POSITIONS[lanes][:, None, :]]  # [n, G, 6, 4]
    new_cells = torch.zeros(new_blocks, groups, CELLS, 4, dtype=torch.uint8)
    column = torch.arange(n)
    new_cells[(column // BLOCK)[:, None, None], group_index[None, :, None], POSITIONS[column % BLOCK][:, None, :]] = picked
    factors = scales[:, : groups * 2 * BLOCK].reshape(-1, groups, 2, BLOCK)
    supers = scales[:, groups * 2 * BLOCK :].reshape(-1, groups // SUPER, BLOCK, 2)
    new_scales = torch.zeros(new_blocks, groups * 36, dtype=torch.uint8)
    new_factors = new_scales[:, : groups * 2 * BLOCK].view(new_blocks, groups, 2, BLOCK)
    new_supers = new_scales[:, groups * 2 * BLOCK :].view(new_blocks, groups // SUPER, BLOCK, 2)
    new_factors[column // BLOCK, :, :, column % BLOCK] = factors[blocks, :, :, lanes]
    new_supers[column // BLOCK, :, column % BLOCK, :] = supers[blocks, :, lanes, :]
    return new_cells.reshape(new_blocks, -1), new_scales
