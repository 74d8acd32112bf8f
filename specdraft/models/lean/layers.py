"""One decoder layer as the lean forward runs it (lean/decoder.py, and its C table,
kernels/native_layers.py): the modules of a transformers layer with the query/key/value and
gate/up projections fused, and the parts only some architectures have named (a QK norm:
Qwen3's RMSNorm over each head's queries and keys before their rotary positions), so that
the forward reads fields, not tuple positions, and a new part is one field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from specdraft.models.kernels.fused_linear import fuse


@dataclass(frozen=True)
class LeanLayer:
    norm1: nn.Module  # before attention
    qkv: nn.Module  # queries, keys and values in one product
    out: nn.Module
    norm2: nn.Module  # before the MLP
    gate_up: nn.Module  # the gate and up projections in one product
    down: nn.Module
    inner: int  # the MLP's width (the gate's outputs)
    q_norm: nn.Module | None = None  # an RMSNorm over each head's D query values (None: none)
    k_norm: nn.Module | None = None

    @classmethod
    def of(cls, layer: nn.Module) -> "LeanLayer":
        """The lean view of a transformers decoder layer (Llama's shape, with Qwen3's QK norm
        where it has one): its projections fused once (fused_linear.fuse), or as the model
        holds them where they are one matrix already (Phi-3's qkv_proj, gate_up_proj)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = projections(layer)
        return cls(layer.input_layernorm, fuse(qkv) if len(qkv) > 1 else qkv[0], attn.o_proj,
                   layer.post_attention_layernorm, fuse(gate_up) if len(gate_up) > 1 else gate_up[0], mlp.down_proj,
                   gate_up[0].out_features // (2 if len(gate_up) == 1 else 1), getattr(attn, "q_norm", None),
                   getattr(attn, "k_norm", None))

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The QK norm's weights [D] and epsilon, as the kernels take them (None: none)."""
        if self.q_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, float(self.q_norm.variance_epsilon)

    def with_products(self, wrap: Callable[[nn.Module], nn.Module]) -> "LeanLayer":
        """The same layer with each of its products replaced by wrap(product)."""
        return dataclasses.replace(self, qkv=wrap(self.qkv), out=wrap(self.out), gate_up=wrap(self.gate_up),
                                   down=wrap(self.down))


def projections(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """A layer's query/key/value matrices and its gate/up matrices, each one fused matrix
    (Phi-3) or the separate ones in order."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return qkv, gate_up


def qk_norm_problem(layer: nn.Module) -> str | None:
    """Why the lean forward cannot run a layer's QK norm, or None (it has none, or an RMSNorm
    with a weight over the head's values)."""
    attn = layer.self_attn
    norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if all(norm is None for norm in norms):
        return None
    for norm in norms:
        if norm is None or getattr(norm, "weight", None) is None or not hasattr(norm, "variance_epsilon"):
            return "its query/key norm is not an RMSNorm with a weight over each head"
    if norms[0].variance_epsilon != norms[1].variance_epsilon:
        return "its query and key norms have different epsilons"
    return None
