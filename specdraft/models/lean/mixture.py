"""A mixture-of-experts MLP as the lean forward runs it (Qwen3-MoE): the router's scores for
each row, the row's `used` highest-scoring experts weighted by their softmax probabilities
(renormalized over the chosen ones where the model does so), and the weighted sum of those
experts' outputs.

On the kernels (the router and every expert's products BlockLinear) it is one C call
(cpu_experts.c), the code the whole-layer C table runs, so both lean paths give the same
numbers bit for bit and a verify row equals the one-token step; otherwise it runs in torch ops
as transformers computes it. A verify block of n rows touches up to n x `used` experts, each
run once over the rows that chose it: models/width_costs.py measures what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.experts import Experts, WeightView


def is_mixture(mlp: nn.Module) -> bool:
    """Whether a layer's MLP is a mixture of experts (a router `gate` and `experts`)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.gate, "top_k")


@dataclass
class Mixture:
    router: nn.Module  # [.., H] -> [.., count] scores
    experts: Experts
    used: int  # the experts each row runs
    normalize: bool  # the chosen experts' probabilities rescaled to sum to 1
    _table: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, mlp: nn.Module, activation: str) -> "Mixture":
        """The lean view of a transformers mixture (Qwen3MoeSparseMoeBlock: router `gate`,
        `experts`): on the kernels where the experts are, the router's float32 weights in the
        kernels' float layout (a few MB a layer) so that its scores are the C table's."""
        gate = mlp.gate
        experts = Experts.of(mlp.experts, activation)
        products = [part for module in [*experts.gate_up, *experts.down] for part in getattr(module, "parts", [module])]
        on_kernels = all(isinstance(p, BlockLinear) for p in products) and gate.weight.dtype == torch.float32
        router = BlockLinear.from_float(gate.weight.detach()) if on_kernels else WeightView(gate.weight)
        return cls(router, experts, int(gate.top_k), bool(gate.norm_topk_prob))

    def table(self) -> Any:
        """The kernels' table of this mixture (built once), or None when it is not on them."""
        if self._table is None:
            from specdraft.models.kernels.native_layers import experts_table

            self._table = experts_table(self) or False
        return self._table or None

    def native(self, h: torch.Tensor) -> torch.Tensor:
        """The mixture over rows h [n, H] on the kernels where it is on them (else `forward`)."""
        table = self.table()
        if table is None:
            return self.forward(h)
        from specdraft.models.kernels.native_layers import run_experts

        return run_experts(table, h.contiguous(), self.experts.activation)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The mixture over h [.., H] in torch ops: [.., H]."""
        rows = h.reshape(-1, h.shape[-1])
        probabilities = torch.softmax(self.router(rows).float(), dim=-1)
        weights, chosen = torch.topk(probabilities, self.used, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(rows, chosen, weights.to(rows.dtype)).view(h.shape)
