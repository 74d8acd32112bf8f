"""A lean decode forward for small Llama-family drafters on a CPU, with its own KV buffer.

A drafter drafts one token per forward. On a CPU, a small model's one-token forward through
transformers spends much of its time outside the matrix products, in the dozens of tensor
ops and module calls of every layer. This forward runs the same arithmetic with what one
token needs and no more:

- the query, key and value projections are one matrix product per layer, and so are the
  MLP's gate and up projections (`fused_linear.fuse`: their weights concatenated once, the
  original layers re-pointed at slices of the concatenation, so no weight is stored twice);
- keys and values go into one preallocated buffer per model (written in place, rolled back
  by moving a length), not a cache object that concatenates per layer;
- fused RMSNorm, SDPA with grouped query heads, no masks for a single token, and the output
  head only at the rows asked for.

The model's modules stay in place (only their projection weights become slices of the fused
ones): transformers' forward of the same object (the assisted-generation baseline,
training, scoring along a trajectory) is unchanged and gives the same logits up to float
rounding. Only drafts come from this forward, and the target verifies every drafted token,
so output stays exactly what plain decoding gives.

Supported: decoder-only models whose layers are Llama's shape (Llama, Qwen2, Mistral,
Qwen3 with its QK norm, Phi-3 with its fused projections, Gemma 3, Qwen3-MoE's mixture of
experts): RMSNorm, rotary positions from the model's own rotary module, gated MLP (one layer:
lean/layers.py). `lean_problem` says why another model is not; it then runs through
transformers as before. On CUDA, static caches with CUDA graphs remove the same overhead.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.models.kv_cache import move_path
from specdraft.models.kernels.native_layers import NativeLayers
from specdraft.models.kernels.native import add_rms_norm, attention_block, geglu, rms_norm, swiglu
from specdraft.models.lean.layers import Norm
from specdraft.models.lean.support import (inverse_frequencies, invariant_attention, lean_layers, lean_problem,
                                           rope_kinds, stack_problem)
from specdraft.models.lean.tree_rows import ancestry, tree_depths, tree_rows

log = logging.getLogger("specdraft")

INITIAL_CAPACITY = 512  # tokens; doubled when a context needs more


class LeanDecoder:
    """The model's decode forward over a KV buffer of its own (batch 1)."""

    def __init__(self, model: nn.Module, stack: nn.Module | None = None):
        """`model`: a causal LM (its `model` is the stack, its `lm_head` reads it out); or,
        with `stack` given, a bare decoder stack fed embeddings (`hidden` only: a draft head)."""
        problem = lean_problem(model) if stack is None else stack_problem(stack)
        if problem is not None:
            raise ValueError(f"the lean forward cannot run this model: {problem}")
        config = model.config
        self.model, self.inner = model, model.model if stack is None else stack
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        # Fused once per model: every lean forward of it (a pool's drafter, a cost probe)
        # shares the concatenated weights.
        self.layers = getattr(model, "_specdraft_lean_layers", None)
        if self.layers is None:
            self.layers = lean_layers(self.inner)
            model._specdraft_lean_layers = self.layers
        self.final_norm = Norm.of(self.inner.norm)
        self.scale = float(getattr(self.inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.rope_kinds = rope_kinds(self.inner)  # the rotary tables the layers read (Gemma 3: two)
        norm = self.inner.norm.weight  # (the embedding may be a quantized table without one)
        self.device, self.dtype = norm.device, norm.dtype
        # specdraft's kernels for everything but the products where they run: each row's
        # result is the same in a verify block of any width (torch's SDPA only promises that
        # up to rounding).
        frequencies = [inverse_frequencies(self.inner, kind) for kind in self.rope_kinds]
        self.invariant = all(f is not None and 2 * f.numel() == self.head_dim for f in frequencies) \
            and invariant_attention(self.device, self.dtype, self.head_dim)
        # The buffer holds no length of its own: the caller (CachedLM) says where each feed
        # starts, so a rollback or a new prompt is only a smaller start next time.
        self.capacity = 0
        self.keys = self.values = torch.empty(0)
        self.whole_layers_in_c = True  # False: layer by layer from Python (the same numbers)
        self._rope: dict = {}  # per rotary table, cos and sin [1, positions, D]: `_rotary`

    def _native_table(self) -> NativeLayers | None:
        """The C layer table of this model's lean layers (built once per model), or None."""
        if not hasattr(self.model, "_specdraft_native_layers"):
            self.model._specdraft_native_layers = NativeLayers.of(self.layers)
        return self.model._specdraft_native_layers

    def _reserve(self, length: int, kept: int) -> None:
        """Room for `length` tokens, keeping the first `kept` when the buffer moves."""
        if length <= self.capacity:
            return
        capacity = max(INITIAL_CAPACITY, self.capacity)
        while capacity < length:
            capacity *= 2
        shape = (len(self.layers), 1, self.kv_heads, capacity, self.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            keys[..., :kept, :] = self.keys[..., :kept, :]
            values[..., :kept, :] = self.values[..., :kept, :]
        self.keys, self.values, self.capacity = keys, values, capacity

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, keep: int, hidden_layers: Sequence[int] = (),
                depth: int | None = None, parents: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Feed `ids` [n] after the first `start` cached tokens (what follows them is
        overwritten): logits of the last `keep` positions (all when 0) [keep, V], and the
        residual stream after each of `hidden_layers` layers at every position ({layer: [n,
        H]}, as transformers' hidden_states[layer]: after the last layer, the final norm's
        output). `depth`: run only the first `depth` layers, then the final norm and head
        (a self-drafter over this buffer). `parents`:
        `ids` are a token tree (`parents[i]` < i the row of i's parent, parents[0] = -1): each
        row sits at position start + its depth and attends its own path; `keep_path` then
        moves the accepted path's keys and values into place."""
        n = ids.shape[-1]
        x, hidden = self.layers_over(self.inner.embed_tokens(ids.view(1, n)), start, hidden_layers, depth, parents)
        rows = x[:, -keep:] if keep else x
        logits = self.model.lm_head(self._norm(rows.contiguous(), self.final_norm))[0]
        hidden = {layer: state[0] for layer, state in hidden.items()}
        final = len(self.layers)
        if final in hidden:  # (only a forward through every layer hands the last one over)
            # transformers' last hidden state is the stack's output after its final norm (what
            # a draft head is trained on), not the residual stream after the last layer
            hidden[final] = self._norm(hidden[final].contiguous(), self.final_norm)
        return logits, hidden

    @torch.inference_mode()
    def hidden(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The stack's output (after its final norm) for input embeddings `x` [1, n, H] fed
        after the first `start` cached positions: [1, n, H]."""
        x = self.layers_over(x, start)[0]
        return self._norm(x.contiguous(), self.final_norm)

    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        if self.invariant:
            return rms_norm(x, norm.weight, norm.eps)
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)

    def pack(self) -> None:
        """Run this forward's float products on oneDNN's packed layout (the fused
        projections included): for a stack whose model the runtime packs."""
        from specdraft.models.kernels.packed_linear import PackedLinear

        def packed(module: nn.Module) -> nn.Module:
            return PackedLinear(module) if type(module) is nn.Linear else module

        self.layers = [layer.with_products(packed) for layer in self.layers]

    def layers_over(self, x: torch.Tensor, start: int, hidden_layers: Sequence[int] = (),
                    depth: int | None = None, parents: Sequence[int] | None = None
                    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The first `depth` layers (all when None) over `x` [1, n, H] at KV slots start..
        (positions start.., or start + depth for a token tree's `parents`: `forward`), keys
        and values kept: the residual stream after the last of them [1, n, H], and after
        each of `hidden_layers` ({layer: [1, n, H]}; layer 0 is the input)."""
        n = x.shape[1]
        end = start + n
        self._reserve(end, start)
        tree = None if parents is None else tree_rows(parents, n)
        offsets = torch.arange(n) if tree is None else tree_depths(tree)
        tables = [self._rotary(x, start + offsets, kind) for kind in self.rope_kinds]  # cos, sin [1, n, D]
        cos, sin = (parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*tables))  # [tables, n, D]
        layers = self.layers[:depth]
        if self.invariant:
            return self._native_layers(x, start, cos.contiguous(), sin.contiguous(), layers, hidden_layers, tree)
        return self._torch_layers(x, start, cos, sin, layers, hidden_layers, tree)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos and sin ([1, n, D] each) at `positions` [n] (a host tensor;
        `kind`: the table of a module with several, Gemma 3's), read from a table of every
        position up to twice the furthest asked (the module's own values: a position's angles
        are its own products, whatever else is computed beside them), so a one-token step does
        not run the module; a rope that rescales with the length (dynamic, longrope) runs it
        every time."""
        rotary, end = self.inner.rotary_emb, int(positions.max()) + 1
        args = () if kind is None else (kind,)
        rope_type = getattr(rotary, "rope_type", "")
        if "dynamic" in rope_type or rope_type == "longrope":
            return rotary(x, positions.to(self.device).view(1, -1), *args)
        table = self._rope.get(kind)
        if table is None or end > table[0].shape[1] or table[0].dtype != x.dtype:
            table = self._rope[kind] = rotary(x, torch.arange(max(INITIAL_CAPACITY, 2 * end),
                                                              device=self.device).view(1, -1), *args)
        at = positions.to(self.device)
        return table[0][:, at], table[1][:, at]

    @torch.inference_mode()
    def keep_path(self, start: int, rows: Sequence[int]) -> None:
        """After a token tree fed at `start`: its rows `rows` (a root-to-node path, row 0
        first) become the cached positions start, start + 1, ..: their keys and values move
        into those slots in every layer (the other rows' are overwritten by the next feed)."""
        move_path((self.keys, self.values), 3, start, rows)  # [layers, 1, KVH, capacity, D]

    def _native_layers(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, layers: list,
                       hidden_layers: Sequence[int], tree: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`layers_over` on specdraft's kernels, a handful of calls per layer: each row's
        arithmetic is its own, so a verify row equals the one-token step bit for bit. The
        residual stream is updated in place, each update fused with the next norm. cos, sin:
        [tables, n, D]."""
        hidden = {0: x} if 0 in hidden_layers else {}
        x = x[0].contiguous().clone()  # [n, H]: the residual stream, owned here
        table = self._native_table() if self.whole_layers_in_c else None
        if table is not None:  # the same kernels in one C call per run of layers
            first = 0
            for end in sorted({layer for layer in hidden_layers if 0 < layer <= len(layers)} | {len(layers)}):
                if end > first:
                    table.run(x, start, first, end - first, self.heads, self.keys, self.values, cos, sin, tree,
                              self.scale)
                if end in hidden_layers:
                    hidden[end] = x.clone()[None]
                first = end
            return x[None], hidden
        pending = None  # the last MLP's output, not yet added to x
        for i, layer in enumerate(layers):
            norm1, norm2 = layer.norm1, layer.norm2
            h = rms_norm(x, norm1.weight, norm1.eps) if pending is None else \
                add_rms_norm(x, pending, norm1.weight, norm1.eps)
            attended = attention_block(layer.qkv(h), cos[layer.rope], sin[layer.rope], self.keys[i][0],
                                       self.values[i][0], start, self.heads, tree, layer.qk_norm(), layer.window,
                                       self.scale)
            delta = layer.out(attended)
            if layer.post_norm1 is not None:
                delta = rms_norm(delta, layer.post_norm1.weight, layer.post_norm1.eps)
            h = add_rms_norm(x, delta, norm2.weight, norm2.eps)
            pending = layer.mlp(h, geglu if layer.activation == "gelu_tanh" else swiglu)
            if layer.post_norm2 is not None:
                pending = rms_norm(pending, layer.post_norm2.weight, layer.post_norm2.eps)
            if i + 1 in hidden_layers:
                x += pending
                pending = None
                hidden[i + 1] = x.clone()[None]
        if pending is not None:
            x += pending
        return x[None], hidden

    def _torch_layers(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, layers: list,
                      hidden_layers: Sequence[int], tree: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`layers_over` in torch ops, SDPA attention (a drafter's forward). cos, sin:
        [tables, n, D]."""
        n = x.shape[1]
        end = start + n
        hidden = {0: x} if 0 in hidden_layers else {}
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        half = dim // 2
        masks = self._masks(start, n, tree)
        for i, layer in enumerate(layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.norm1.weight, layer.norm1.eps)
            q, k, v = layer.qkv(h).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q, k = q.view(1, n, heads, dim), k.view(1, n, kv_heads, dim)
            if layer.q_norm is not None:
                q_weight, k_weight, eps = layer.qk_norm()
                q, k = F.rms_norm(q, (dim,), q_weight, eps), F.rms_norm(k, (dim,), k_weight, eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            c, s = cos[layer.rope][None, None], sin[layer.rope][None, None]  # [1, 1, n, D]
            q = q * c + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * s
            k = k * c + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * s
            keys, values = self.keys[i], self.values[i]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v.view(1, n, kv_heads, dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end],
                                                      attn_mask=masks.get(layer.window), scale=self.scale,
                                                      enable_gqa=heads != kv_heads)
            delta = layer.out(attended.transpose(1, 2).reshape(1, n, heads * dim))
            if layer.post_norm1 is not None:
                delta = F.rms_norm(delta, (delta.shape[-1],), layer.post_norm1.weight, layer.post_norm1.eps)
            x = x + delta
            h = F.rms_norm(x, (x.shape[-1],), layer.norm2.weight, layer.norm2.eps)
            if layer.experts is not None:
                delta = layer.experts.forward(h)
            else:
                gate, up = layer.gate_up(h).split([layer.inner, layer.inner], dim=-1)
                act = F.gelu(gate, approximate="tanh") if layer.activation == "gelu_tanh" else F.silu(gate)
                delta = layer.down(act * up)
            if layer.post_norm2 is not None:
                delta = F.rms_norm(delta, (delta.shape[-1],), layer.post_norm2.weight, layer.post_norm2.eps)
            x = x + delta
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        return x, hidden

    def _masks(self, start: int, n: int, tree: torch.Tensor | None) -> dict:
        """{window: the attention mask [n, start + n] of a layer with that sliding window (0:
        none)}: one new token attends to everything cached (no mask); a block attends
        causally, a tree's row its own path; a window keeps a row's keys less than `window`
        positions back."""
        end = start + n
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        if tree is not None:
            mask[:, start:] = ancestry(tree).to(self.device)
        masks = {0: mask}
        windows = {layer.window for layer in self.layers if layer.window}
        if windows:
            depths = torch.arange(n) if tree is None else tree_depths(tree)
            rows = (start + depths).to(self.device)[:, None]  # each row's position
            keys = torch.cat([torch.arange(start), start + depths]).to(self.device)[None, :]  # each key slot's
            for window in windows:
                near = rows - keys < window
                masks[window] = near if mask is None else mask & near
        return masks
