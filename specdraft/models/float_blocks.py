"""A bfloat16 model on a CPU, run on specdraft's block kernels (`dtype = "bfloat16"`).

torch's bfloat16 products (oneDNN, or its own kernels) block the rows of a product by the
number of rows, so a verify over K + 1 tokens gives a row other logits than a one-token step
does, and at a near-tie another argmax: speculative output would part from the model's own
plain decoding. Here every matrix of the decoder layers and the head keeps its bfloat16
weights, in the block kernels' layout (`BlockLinear.from_float`), where each output's sum
runs in an order fixed by its own row and column (cpu_kernels_shared.h); the norms, biases,
residual stream, attention and KV cache run in float32 on the lean forward, whose kernels are
width-invariant too. So the model as run is "bfloat16 weights, float32 arithmetic" (what
llama.cpp does with a BF16 file), the same in a one-token step and in a verify of any width,
with the weights' memory of bfloat16. The input embedding stays a bfloat16 table looked up
as float32 rows, or, tied to the head, reads the head's rows.

Only where the lean forward runs the model (lean/support.py's lean_problem) and the kernels build
(native.kernel_problem); elsewhere the model stays on torch's kernels with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.quantized_embedding import TiedEmbedding

log = logging.getLogger("specdraft")


class FloatRowsEmbedding(nn.Module):
    """An embedding table kept in its dtype (bfloat16), returning float32 rows."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("table", weight.detach().contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids].float()

    @property
    def weight(self) -> torch.Tensor:
        return self.table


def block_kernel_problem(model: nn.Module) -> str | None:
    """Why `model` cannot run on the block kernels with float weights, or None when it can."""
    from specdraft.models.lean.support import lean_problem
    from specdraft.models.kernels.native import kernel_problem

    if next(model.parameters()).device.type != "cpu":
        return "it is not on a CPU"
    return kernel_problem() or lean_problem(model)


def to_float_blocks(model: nn.Module) -> int:
    """Move `model`'s decoder-layer projections and head onto the block kernels, each kept in
    its own dtype (module docstring); norms and biases become float32. Returns how many
    matrices moved. The caller checked `block_kernel_problem`."""
    inner = model.model
    embedding = inner.embed_tokens
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is not None \
        and head.weight.data_ptr() == embedding.weight.data_ptr()
    moved = 0
    if type(head) is nn.Linear:  # first: a tied head shares the embedding's weight
        blocks = _blocks_of(head)
        model.set_output_embeddings(blocks)
        moved += 1
        inner.embed_tokens = TiedEmbedding(blocks) if tied else FloatRowsEmbedding(embedding.weight)
    elif type(embedding) is nn.Embedding:
        inner.embed_tokens = FloatRowsEmbedding(embedding.weight)
    for layer in inner.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, _blocks_of(child))
                    moved += 1
    for module in model.modules():  # the parameters left (norms): float32
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype != torch.float32:
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
    model.config.tie_word_embeddings = False  # two modules now: transformers must not re-tie them
    return moved


def _blocks_of(linear: nn.Linear) -> BlockLinear:
    bias = None if linear.bias is None else linear.bias.detach().float()
    return BlockLinear.from_float(linear.weight.detach(), bias)
