"""The experts of a mixture-of-experts MLP (Qwen3-MoE) as modules: per expert its gate and up
projections side by side (one product, or two parts of one: fused_linear.Concatenated) and its
down projection, each any linear module (a BlockLinear on a GGUF file's own codes, or a float
nn.Linear).

`forward` takes what transformers' experts module takes (Qwen3MoeExperts: the rows, each
row's chosen experts and their weights), so the model's own forward runs with these in its
place; the lean forward runs them through the kernels' table (native_layers.py) or
lean/mixture.py. A float model's experts (3D parameters) become per-expert views of them
(`Experts.of`), so nothing is copied.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class WeightView(nn.Module):
    """x @ weight.T for a weight that is a view of a larger parameter (no copy)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """`count` gated MLPs: expert e is down[e](act(gate) * up), (gate, up) = gate_up[e](x)."""

    def __init__(self, gate_up: Sequence[nn.Module], down: Sequence[nn.Module], activation: str = "silu"):
        super().__init__()
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"experts need as many gate/up as down projections, not {len(gate_up)} and {len(down)}")
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.num_experts, self.activation = len(down), activation
        first = getattr(gate_up[0], "parts", [gate_up[0]])  # (gate and up side by side: fused_linear.Concatenated)
        self.intermediate_dim = sum(part.out_features for part in first) // 2

    @classmethod
    def of(cls, module: nn.Module, activation: str = "silu") -> "Experts":
        """`module` itself, or transformers' experts module (3D `gate_up_proj` [E, 2I, H] and
        `down_proj` [E, H, I]) as per-expert views of its parameters."""
        if isinstance(module, cls):
            return module
        gate_up, down = module.gate_up_proj, module.down_proj
        return cls([WeightView(gate_up[e]) for e in range(gate_up.shape[0])], [WeightView(down[e]) for e in range(down.shape[0])],
                   activation)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).chunk(2, dim=-1)
        return self.down[e](ACTIVATIONS[self.activation](gate) * up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """rows [T, H], each row's experts [T, k] and weights [T, k] -> [T, H]: the weighted sum
        of each row's experts' outputs, added in expert order."""
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            rows, slots = torch.where(top_k_index == e)
            weighted = self.expert(e, hidden_states[rows]) * top_k_weights[rows, slots, None]
            out.index_add_(0, rows, weighted.to(out.dtype))
        return out
