"""Projections that read the same input computed as one layer (the query, key and value
projections; the MLP's gate and up projections): their weight tensors concatenated once, each
original layer re-pointed at its slice so no weight is stored twice, or, where formats differ
or block boundaries do not meet, the parts run side by side (`Concatenated`)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from specdraft.models.kernels.block_linear import BLOCK, BlockLinear
from specdraft.models.kernels.quantize import Int4Linear

INT4_PACK_ROWS = 64  # torch's CPU int4 packing interleaves blocks of this many output rows


class Concatenated(nn.Module):
    """[p(x) for p in parts] concatenated, for parts whose weights cannot be fused."""

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        self.parts = list(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fuse(parts: Sequence[nn.Module]) -> nn.Module:
    """One layer computing [p(x) for p in parts] concatenated, sharing the parts' weights:
    the big weight tensors are concatenated once and each part is re-pointed at its slice.
    Packed int4 rows and block-layout columns concatenate only at block boundaries; parts in
    different formats (a GGUF file may store the value projection with more bits than the
    query's), with scales held in different forms (scale_forms.py) or meeting activations
    rounded differently (block_linear.BlockLinear.activations) stay separate."""
    first = parts[0]
    if len({type(p) for p in parts}) > 1 or len({getattr(p, "group", 0) for p in parts}) > 1 \
            or len({(getattr(p, "terms", 1), getattr(p, "bits", 0), getattr(p, "scale_form", 0),
                     getattr(p, "activations", 0)) for p in parts}) > 1 \
            or (isinstance(first, Int4Linear) and any(p.out_features % INT4_PACK_ROWS for p in parts[:-1])) \
            or (isinstance(first, BlockLinear) and any(p.out_features % BLOCK for p in parts[:-1])):
        return Concatenated(parts)
    if isinstance(first, BlockLinear):
        return _fuse_blocks(parts)
    some = next((p.bias for p in parts if p.bias is not None), None)
    bias = None if some is None else torch.cat(
        [p.bias.detach() if p.bias is not None else some.new_zeros(p.out_features) for p in parts])
    sizes = [p.out_features for p in parts]
    if isinstance(first, nn.Linear):
        weight = torch.cat([p.weight.detach() for p in parts])
        for p, w in zip(parts, weight.split(sizes)):
            p.weight = nn.Parameter(w, requires_grad=False)
        fused = nn.Linear(first.in_features, sum(sizes), bias=bias is not None, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
        return fused
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = first.in_features, sum(sizes)
    if isinstance(first, Int4Linear):
        fused.group = first.group
        packed = torch.cat([p.weight_int4 for p in parts])  # output rows stay rows (blocks of 64 aligned)
        for p, w in zip(parts, packed.split(sizes)):
            p.weight_int4 = w
        fused.register_buffer("weight_int4", packed)
        fused.register_buffer("scales_zeros", torch.cat([p.scales_zeros for p in parts], dim=1).contiguous())
    else:
        codes = torch.cat([p.weight_int8 for p in parts])
        for p, w in zip(parts, codes.split(sizes)):
            p.weight_int8 = w
        fused.register_buffer("weight_int8", codes)
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return fused


def _fuse_blocks(parts: Sequence[BlockLinear]) -> BlockLinear:
    """BlockLinear parts fused along their output rows (their buffers become slices)."""
    sizes = [p.out_features for p in parts]
    blocks = [p.codes.shape[0] for p in parts]  # the buffers' first dimension: blocks of columns
    bits = parts[0].bits
    tensors = {"offsets": None, "scales": torch.zeros(0)}  # float weights have neither
    for name in ("codes", "scales", "offsets")[:{4: 3, 6: 2, 8: 2}.get(bits, 1)]:
        pieces = [getattr(p, name) for p in parts]
        tensors[name] = adjacent(pieces)
        if tensors[name] is None:
            tensors[name] = torch.cat(pieces)
            for p, piece in zip(parts, tensors[name].split(blocks)):
                setattr(p, name, piece)
    some = next((p.bias for p in parts if p.bias is not None), None)
    bias = None if some is None else torch.cat(
        [p.bias.detach() if p.bias is not None else some.new_zeros(p.out_features) for p in parts])
    fused = BlockLinear(tensors["codes"], tensors["scales"], tensors["offsets"], parts[0].terms, bias, sum(sizes),
                        float_inputs=parts[0].in_features if bits in (16, 32) else None, bits=bits)
    fused.activations = parts[0].activations
    return fused


def adjacent(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The pieces as one tensor along their first dimension without a copy, where they lie
    one after the other in one storage already (parts fused before: models/gguf/weights.py
    fuses them as a model loads); None where they do not."""
    first = pieces[0]
    rows, end = 0, first.data_ptr()
    for piece in pieces:
        if (not piece.is_contiguous() or piece.dtype != first.dtype or piece.shape[1:] != first.shape[1:]
                or piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or piece.data_ptr() != end):
            return None
        rows, end = rows + piece.shape[0], end + piece.numel() * piece.element_size()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
