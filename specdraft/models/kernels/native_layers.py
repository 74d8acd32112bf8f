"""The lean target's decoder layers as one C call a step (cpu_decoder.c): a table of every
layer's weights, norms and biases (their addresses, taken once), and the call that runs a run
of consecutive layers over the residual stream. The C side runs the same kernels in the same
order as the layer-by-layer path in lean/decoder.py, so the two give the same logits bit for
bit; only the hundred-odd trips through Python a step are gone.

A layer (lean/layers.py's LeanLayer) fits the table when each projection is a BlockLinear, or
(query/key/value, gate/up) up to three of them side by side, and its norms (the QK norm's
included) are RMSNorms with a float32 weight; otherwise the model keeps the layer-by-layer
path. A mixture of experts (lean/mixture.py) fits when its router and every expert's products
do: its own table (`experts_table`), which the layer-by-layer path runs too (`run_experts`).
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
from specdraft.models.kernels.structs import Experts as _Experts
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
    return _Matrix(*layer.addresses, bias, layer.out_features, layer.groups, layer.bits, layer.scale_form,
                   layer.activations)


class ExpertsTable:
    """A mixture's C table (Experts, cpu_kernels_shared.h) and the Matrix arrays it points to,
    kept alive together."""

    def __init__(self, struct: _Experts, arrays: tuple, hidden: int):
        self.struct, self.arrays, self.hidden = struct, arrays, hidden

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)


def experts_table(mixture: Any) -> ExpertsTable | None:
    """The C table of a lean mixture of experts (lean/mixture.py), or None when its router or
    an expert's product is not on the block kernels."""
    experts = mixture.experts
    router = _parts(mixture.router)
    gate_ups = [_parts(module) for module in experts.gate_up]
    downs = [_parts(module) for module in experts.down]
    if router is None or len(router) != 1 or any(g is None for g in gate_ups) or any(d is None or len(d) != 1
                                                                                     for d in downs):
        return None
    parts = len(gate_ups[0])
    if any(len(g) != parts for g in gate_ups):
        return None
    gate_up = (_Matrix * (parts * len(gate_ups)))(*[_matrix(m) for g in gate_ups for m in g])
    down = (_Matrix * len(downs))(*[_matrix(d[0]) for d in downs])
    struct = _Experts(_matrix(router[0]), ctypes.addressof(gate_up), ctypes.addressof(down), len(downs),
                      mixture.used, parts, int(mixture.normalize))
    return ExpertsTable(struct, (gate_up, down), router[0].in_features)


def run_experts(table: ExpertsTable, h: torch.Tensor, activation: str) -> torch.Tensor:
    """The mixture over rows h [n, H] (float32, contiguous) on the kernels: [n, H]."""
    name = "expert_mlp"
    pointer = address(name, "h", h, (None, table.hidden))
    out = torch.empty_like(h)
    check_status(name, library().expert_mlp(pointer, h.shape[0], h.shape[1], table.address,
                                            ACTIVATIONS[activation], out.data_ptr(), torch.get_num_threads()))
    return out


NORMS = ("norm1", "norm2", "q_norm", "k_norm", "post_norm1", "post_norm2")  # a layer's, named as Layer's fields
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # cpu_kernels_shared.h ACT_*


def _fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu"


class NativeLayers:
    """The layer table of one model's lean layers (`LeanDecoder.layers`), built once. Like
    BlockLinear's own cached addresses, it points into the modules' tensors: it stays valid
    while the model keeps them (the model holds the table)."""

    def __init__(self, table: ctypes.Array, experts: Sequence[ExpertsTable] = ()):
        self.table, self.experts = table, experts  # (the mixtures' tables the layer table points to)

    @classmethod
    def of(cls, layers: Sequence[Any]) -> "NativeLayers | None":
        """The table, or None when some layer does not fit it (module docstring)."""
        table, mixtures = (_Layer * len(layers))(), []
        for entry, layer in zip(table, layers):
            mixture = None if layer.experts is None else layer.experts.table()
            if layer.experts is not None and mixture is None:
                return None
            dense = [[], [None]] if mixture else [_parts(layer.gate_up), _parts(layer.down)]
            groups = [_parts(layer.qkv), dense[0], _parts(layer.out), dense[1]]
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
            entry.out = _matrix(groups[2][0])
            if mixture is not None:
                entry.experts = mixture.address
                mixtures.append(mixture)
            else:
                entry.down = _matrix(groups[3][0])
        return cls(table, mixtures)

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
