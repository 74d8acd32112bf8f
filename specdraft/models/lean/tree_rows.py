"""A token tree's rows as the target's forward reads them: each row's parent (the kernels'
int32 rows), its depth below the root (its position offset) and its path from the root (the
attention mask of the torch path). Row 0 is the root; every other row's parent comes first."""

from __future__ import annotations

from typing import Sequence

import torch


def tree_rows(parents: Sequence[int], n: int) -> torch.Tensor:
    """A token tree's parent rows as the kernels read them (int32 [n]); ValueError unless row
    0 is the root (-1) and every other row's parent comes before it."""
    tree = torch.as_tensor(list(parents), dtype=torch.int32)
    if tree.shape != (n,) or int(tree[0]) != -1 or any(not 0 <= int(p) < i for i, p in enumerate(tree[1:], 1)):
        raise ValueError(f"not a token tree of {n} rows (row 0 the root, each parent before its child): "
                         f"{list(parents)}")
    return tree


def tree_depths(tree: torch.Tensor) -> torch.Tensor:
    """Each row's depth below the root (row 0, depth 0): [n] long."""
    depths = [0] * len(tree)
    for i in range(1, len(tree)):
        depths[i] = depths[int(tree[i])] + 1
    return torch.tensor(depths)


def ancestry(tree: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: row i's path from the root (its ancestors and itself)."""
    n = len(tree)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(tree[i])]
    return mask
