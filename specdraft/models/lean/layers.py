"""One decoder layer as the lean forward runs it (lean/decoder.py, and its C table,
kernels/native_layers.py): the modules of a transformers layer with the query/key/value and
gate/up projections fused, its norms as the weights the kernels multiply by, and the parts only
some architectures have named, so that the forward reads fields, not tuple positions, and a
new part is one field:

- a QK norm (Qwen3, Gemma 3): an RMSNorm over each head's queries and keys before their rotary
  positions;
- post-norms (Gemma 3): an RMSNorm of the attention's and of the MLP's output before each is
  added to the residual stream;
- the MLP's activation: SiLU, or GELU in its tanh form (Gemma);
- a sliding window (Gemma 3's local layers) and which rotary table the layer reads (Gemma 3's
  local and global layers have their own bases);
- a mixture of experts in place of the dense MLP (Qwen3-MoE: lean/mixture.py).

Gemma's RMSNorm multiplies by 1 + weight (its weights are stored as offsets from 1): `Norm`
holds what the kernels multiply by, computed once as transformers computes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from specdraft.models.kernels.fused_linear import fuse
from specdraft.models.lean.mixture import Mixture, is_mixture

GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")  # x / rms(x) * (1 + weight)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Norm:
    """An RMSNorm as the kernels run it: x / sqrt(mean(x^2) + eps) * weight."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> "Norm":
        weight = module.weight
        if type(module).__name__ in GEMMA_NORMS:
            return cls((1.0 + weight.detach().float()).contiguous(), float(module.eps))
        return cls(weight, float(module.variance_epsilon))


def norm_problem(module: nn.Module | None) -> str | None:
    """Why a module is not an RMSNorm the lean forward runs (None: it is)."""
    if module is None or getattr(module, "weight", None) is None:
        return "a norm without a weight"
    if type(module).__name__ in GEMMA_NORMS:
        return None if hasattr(module, "eps") else f"a {type(module).__name__} without eps"
    return None if hasattr(module, "variance_epsilon") else f"a {type(module).__name__} is not an RMSNorm it knows"


@dataclass(frozen=True)
class LeanLayer:
    norm1: Norm  # before attention
    qkv: nn.Module  # queries, keys and values in one product
    out: nn.Module
    norm2: Norm  # before the MLP
    gate_up: nn.Module | None  # the gate and up projections in one product (None: experts)
    down: nn.Module | None
    inner: int  # the MLP's width (the gate's outputs; an expert's)
    q_norm: Norm | None = None  # over each head's D query values (None: none)
    k_norm: Norm | None = None
    post_norm1: Norm | None = None  # of the attention's output (None: none)
    post_norm2: Norm | None = None  # of the MLP's output
    activation: str = "silu"  # or "gelu_tanh"
    window: int = 0  # the positions a row attends back to, itself included (0: all)
    rope: int = 0  # which of the model's rotary tables (decoder.py `rope_kinds`)
    experts: Mixture | None = None  # the MLP is this mixture of experts (None: dense)

    @classmethod
    def of(cls, layer: nn.Module, activation: str = "silu", window: int = 0, rope: int = 0) -> "LeanLayer":
        """The lean view of a transformers decoder layer (Llama's shape, Qwen3's QK norm, Gemma
        3's post-norms): its projections fused once (fused_linear.fuse), or as the model holds
        them where they are one matrix already (Phi-3's qkv_proj, gate_up_proj)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = projections(layer)
        # Gemma's post_attention_layernorm follows attention; its pre_feedforward_layernorm is
        # what Llama calls post_attention_layernorm, the norm before the MLP
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        norm2 = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        experts = Mixture.of(mlp, activation) if is_mixture(mlp) else None
        dense = (None, None, experts.experts.intermediate_dim) if experts else \
            (fuse(gate_up) if len(gate_up) > 1 else gate_up[0], mlp.down_proj,
             gate_up[0].out_features // (2 if len(gate_up) == 1 else 1))
        return cls(Norm.of(layer.input_layernorm), fuse(qkv) if len(qkv) > 1 else qkv[0], attn.o_proj,
                   Norm.of(norm2), *dense, experts=experts,
                   q_norm=_optional(attn, "q_norm"), k_norm=_optional(attn, "k_norm"),
                   post_norm1=_optional(layer, "post_attention_layernorm") if gemma else None,
                   post_norm2=_optional(layer, "post_feedforward_layernorm"), activation=activation, window=window,
                   rope=rope)

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The QK norm's weights [D] and epsilon, as the kernels take them (None: none)."""
        if self.q_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def with_products(self, wrap: Callable[[nn.Module], nn.Module]) -> "LeanLayer":
        """The same layer with each of its products replaced by wrap(product)."""
        if self.experts is not None:  # (the experts keep their own products)
            return dataclasses.replace(self, qkv=wrap(self.qkv), out=wrap(self.out))
        return dataclasses.replace(self, qkv=wrap(self.qkv), out=wrap(self.out), gate_up=wrap(self.gate_up),
                                   down=wrap(self.down))

    def mlp(self, h: torch.Tensor, gated: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The MLP's output for normed rows h: its experts' (on the kernels where they are), or
        down(gated(gate_up(h)))."""
        if self.experts is not None:
            return self.experts.native(h)
        return self.down(gated(self.gate_up(h)))


def _optional(holder: nn.Module, name: str) -> Norm | None:
    module = getattr(holder, name, None)
    return None if module is None else Norm.of(module)


def projections(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """A layer's query/key/value matrices and its gate/up matrices, each one fused matrix
    (Phi-3) or the separate ones in order (none for a mixture of experts)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    if is_mixture(mlp):
        return qkv, []
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return qkv, gate_up


def layer_norm_problem(layer: nn.Module) -> str | None:
    """Why the lean forward cannot run a layer's norms, or None."""
    attn = layer.self_attn
    names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in [n for n in names if hasattr(layer, n)]:
        problem = norm_problem(getattr(layer, name))
        if problem is not None:
            return f"its {name} is {problem}"
    norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if all(norm is None for norm in norms):
        return None
    if any(norm_problem(norm) for norm in norms):
        return "its query/key norm is not an RMSNorm with a weight over each head"
    if Norm.of(norms[0]).eps != Norm.of(norms[1]).eps:
        return "its query and key norms have different epsilons"
    return None
