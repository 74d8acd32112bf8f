"""The input embedding of a model on its GGUF file's own quantization: looked up from the
file's blocks, or, when it is the head's matrix, from the head's codes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.formats import block_terms, dequantized, has_terms

_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


class TiedEmbedding(nn.Module):
    """The input embedding of a model whose head is the same matrix: rows are read from the
    head's codes, so the table is held once."""

    def __init__(self, head: BlockLinear):
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (a fresh tensor, for one-off readers)."""
        return self.head.rows(torch.arange(self.num_embeddings))


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as the file's own blocks ([V, bytes per row] uint8): a lookup
    dequantizes only the rows it reads, exactly as the file defines them."""

    def __init__(self, blocks: torch.Tensor, type_name: str, dim: int):
        super().__init__()
        self.type_name = type_name
        self.num_embeddings, self.embedding_dim = blocks.shape[0], dim
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` [n] -> [n, D] float32."""
        raw = self.blocks.index_select(0, ids.cpu()).numpy()
        shape = (len(raw), self.embedding_dim)
        if self.type_name in _FLOAT_TYPES:
            values = raw.view(_FLOAT_TYPES[self.type_name])
        elif has_terms(self.type_name, self.embedding_dim):
            values = block_terms(self.type_name, raw, shape).dense()
        else:  # (not rounded to int8 rows, as a product's fallback is: a row is read, not multiplied)
            values = dequantized(self.type_name, raw, shape)
        return torch.from_numpy(np.asarray(values, dtype=np.float32))

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (a fresh tensor: for one-off readers such as a draft
        head's signature, not for a step)."""
        return self.rows(torch.arange(self.num_embeddings))


class ScaledEmbedding(nn.Module):
    """An embedding whose rows come out multiplied by a constant: Gemma's sqrt(hidden size),
    as transformers' Gemma3TextScaledWordEmbedding applies it (a float32 scalar, after the
    lookup). `weight` is the table itself, unscaled, as there."""

    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner = inner
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids) * self.embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight
