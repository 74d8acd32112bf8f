"""The lean target's decoder layers as one C call a step (cpu_decoder.c): a table of every
layer's weights, norms and biases (their addresses, taken once), and the call that runs a run
of consecutive layers over the residual stream. The C side runs the same kernels in the same
order as the layer-by-layer path in lean/decoder.py, so the two give the same logits bit for
bit; only the hundred-odd trips through Python a step are gone.

A layer (lean/layers.py's LeanLayer) fits the table when each projection is a BlockLinear, or
(query/key/value, gate/up) up to three of them side by side, and its norms (the QK norm's
included) are RMSNorms with a float32 weight; otherwise the model keeps the layer-by-layer
path.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.boundary import address, check_status
from specdraft.models.kernels.fused_linear import Concatenated
from specdraft.models.kernels.native import library, parent_rows
from specdraft.models.kernels.structs import MAX_PARTS
from specdraft.models.kernels.structs import Layer as _Layer
from specdraft.models.kernels.structs import Matrix as _Matrix


def _parts(module: nn.Module) -> list[BlockLinear] | None:
    """A projection's matrices side by side, or None when one is not on the block kernels."""
    parts = module.parts if isinstance(module, Concatenated) else [module]
    if len(parts) > MAX_PARTS or not all(type(p) is BlockLinear for p in parts):
        return None
    return list(parts)


def _matrix(layer: BlockLinear) -> _Matrix:
    layer.check_buffers()
    bias = None if layer.bias is None else address("decoder_layers", "a bias", layer.bias.data, (layer.out_features,))
    return _Matrix(*layer.addresses, bias, layer.out_features, layer.groups, layer.bits, layer.scale_form)


NORMS = ("norm1", "norm2", "q_norm", "k_norm", "post_norm1", "post_norm2")  # a layer's, named as Layer's fields
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # cpu_kernels_shared.h ACT_*


def _fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu"


class NativeLayers:
    """The layer table of one model's lean layers (`LeanDecoder.layers`), built once. Like
    BlockLinear's own cached addresses, it points into the modules' tensors: it stays valid
    while the model keeps them (the model holds the table)."""

    def __init__(self, table: ctypes.Array):
        self.table = table

    @classmethod
    def of(cls, layers: Sequence[Any]) -> "NativeLayers | None":
        """The table, or None when some layer does not fit it (module docstring)."""
        table = (_Layer * len(layers))()
        for entry, layer in zip(table, layers):
            groups = [_parts(layer.qkv), _parts(layer.gate_up), _parts(layer.out), _parts(layer.down)]
            norms = {name: getattr(layer, name) for name in NORMS if getattr(layer, name) is not None}
            # (a side's post-norm shares the epsilon of the norm before it: the C layer holds one per side)
            one_eps = all(post is None or post.eps == pre.eps
                          for pre, post in ((layer.norm1, layer.post_norm1), (layer.norm2, layer.post_norm2)))
            if any(g is None for g in groups) or not all(_fits(norm.weight) for norm in norms.values()) \
                    or len(groups[2]) != 1 or len(groups[3]) != 1 or not one_eps:
                return None
            for name, norm in norms.items():
                setattr(entry, name, norm.weight.data_ptr())
            entry.eps1, entry.eps2 = layer.norm1.eps, layer.norm2.eps
            entry.qk_eps = layer.q_norm.eps if layer.q_norm is not None else 0.0
            entry.activation, entry.window, entry.rope = ACTIVATIONS[layer.activation], layer.window, layer.rope
            for slot, matrix in enumerate(groups[0]):
                entry.qkv[slot] = _matrix(matrix)
            for slot, matrix in enumerate(groups[1]):
                entry.gate_up[slot] = _matrix(matrix)
            entry.qkv_parts, entry.gate_up_parts = len(groups[0]), len(groups[1])
            entry.out, entry.down = _matrix(groups[2][0]), _matrix(groups[3][0])
        return cls(table)

    def run(self, x: torch.Tensor, start: int, first: int, count: int, heads: int, keys: torch.Tensor,
            values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parents: torch.Tensor | None = None,
            scale: float | None = None) -> None:
        """Layers first .. first + count - 1 over the residual stream x [n, H] (float32,
        contiguous, updated in place) at KV slots start..; keys and values [layers, 1, KVH,
        capacity, D]; cos, sin [n, D] at each row's position, or [tables, n, D] for models
        whose layers read different rotary tables (a layer's `rope`); `parents` (int32 [n])
        for a token tree (native.causal_attention); `scale` of the scores (None: D ** -0.5)."""
        name = "decoder_layers"
        if x.dim() != 2 or keys.dim() != 5 or not 0 <= first < first + count <= min(len(self.table), len(keys)):
            raise ValueError(f"{name}: x must be [n, H] and keys [layers, 1, KVH, capacity, D] holding layers "
                             f"{first} .. {first + count - 1} of the table's {len(self.table)}, not {tuple(x.shape)} "
                             f"and {tuple(keys.shape)}")
        n, hidden = x.shape
        _, _, kv_heads, capacity, dim = keys.shape
        address(name, "keys", keys), address(name, "values", values, keys.shape)  # (whole: C reads `count` layers)
        tables = cos.shape[0] if cos.dim() == 3 else 1
        shape = (tables, n, dim) if cos.dim() == 3 else (n, dim)
        rope = [address(name, "cos", cos, shape), address(name, "sin", sin, shape), tables]
        layer = ctypes.addressof(self.table) + first * ctypes.sizeof(_Layer)
        check_status(name, library().decoder_layers(address(name, "x", x), n, hidden, start, layer, count, heads,
                                                    kv_heads, dim, keys[first].data_ptr(), values[first].data_ptr(),
                                                    capacity, *rope, dim ** -0.5 if scale is None else scale,
                                                    parent_rows(name, parents, n),
                                                    torch.get_num_threads()))
