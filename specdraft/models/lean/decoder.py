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

Supported: decoder-only models whose layers are Llama's shape (Llama, Qwen2, Mistral
without sliding windows, Qwen3 with its QK norm, Phi-3 with its fused projections): RMSNorm, rotary positions from the model's
own rotary module, gated SiLU MLP (one layer: lean/layers.py). `lean_problem` says why another model is not; it then runs through
transformers as before. On CUDA, static caches with CUDA graphs remove the same overhead.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kv_cache import move_path
from specdraft.models.kernels.native_layers import NativeLayers
from specdraft.models.kernels.native import add_rms_norm, attention_block, rms_norm, swiglu
from specdraft.models.kernels.quantize import Int4Linear, Int8Linear
from specdraft.models.lean.layers import LeanLayer, projections, qk_norm_problem
from specdraft.models.lean.tree_rows import ancestry, tree_depths, tree_rows

log = logging.getLogger("specdraft")

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
INITIAL_CAPACITY = 512  # tokens; doubled when a context needs more


def lean_problem(model: nn.Module) -> str | None:
    """Why the lean forward cannot run `model`, or None when it can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    config = model.config
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if sliding or (name == "MistralForCausalLM" and getattr(config, "sliding_window", None)):
        return "it has sliding-window attention"
    if getattr(config, "pretraining_tp", 1) > 1:
        return "it splits its projections (pretraining_tp)"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "its rotary positions cover only part of each head (partial_rotary_factor)"
    return stack_problem(getattr(model, "model", None), model)


def stack_problem(inner: nn.Module | None, model: nn.Module | None = None) -> str | None:
    """Why the lean forward cannot run the decoder stack `inner` (a LlamaModel-like body:
    layers, rotary module, final norm) of `model` (itself, when it is a bare stack)."""
    model = inner if model is None else model
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None:
        return "its decoder has no layers or rotary module where Llama's has them"
    if getattr(inner.config, "hidden_act", "silu") != "silu":
        return f"its MLP activation is {inner.config.hidden_act}"
    linear = (nn.Linear, Int4Linear, Int8Linear, BlockLinear)
    for layer in layers:
        qkv, gate_up = projections(layer)
        parts = [*qkv, layer.self_attn.o_proj, *gate_up, layer.mlp.down_proj]
        if not all(isinstance(p, linear) for p in parts):
            return "some of its projections are not linear layers this forward knows"
        problem = qk_norm_problem(layer)
        if problem is not None:
            return problem
    if any(_changing_hooks(module) for module in model.modules()):
        return "forward hooks change its tensors (they would be skipped)"
    return None


def _changing_hooks(module: nn.Module) -> list:
    """The module's forward hooks, less transformers' own output capturing (installed for
    good by a call with output_hidden_states, it records tensors and changes none)."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return [hook for hook in hooks if "output_capturing_hook" not in getattr(hook, "__qualname__", "")]


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
            self.layers = [LeanLayer.of(layer) for layer in self.inner.layers]
            model._specdraft_lean_layers = self.layers
        norm = self.inner.norm.weight  # (the embedding may be a quantized table without one)
        self.device, self.dtype = norm.device, norm.dtype
        # specdraft's kernels for everything but the products where they run: each row's
        # result is the same in a verify block of any width (torch's SDPA only promises that
        # up to rounding).
        rotary = getattr(self.inner.rotary_emb, "inv_freq", None)
        self.invariant = rotary is not None and 2 * rotary.numel() == self.head_dim \
            and _invariant_attention(self.device, self.dtype, self.head_dim)
        # The buffer holds no length of its own: the caller (CachedLM) says where each feed
        # starts, so a rollback or a new prompt is only a smaller start next time.
        self.capacity = 0
        self.keys = self.values = torch.empty(0)
        self.whole_layers_in_c = True  # False: layer by layer from Python (the same numbers)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [1, positions, D]: `_rotary`

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
        logits = self.model.lm_head(self._norm(rows.contiguous(), self.inner.norm))[0]
        hidden = {layer: state[0] for layer, state in hidden.items()}
        final = len(self.layers)
        if final in hidden:  # (only a forward through every layer hands the last one over)
            # transformers' last hidden state is the stack's output after its final norm (what
            # a draft head is trained on), not the residual stream after the last layer
            hidden[final] = self._norm(hidden[final].contiguous(), self.inner.norm)
        return logits, hidden

    @torch.inference_mode()
    def hidden(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The stack's output (after its final norm) for input embeddings `x` [1, n, H] fed
        after the first `start` cached positions: [1, n, H]."""
        x = self.layers_over(x, start)[0]
        return self._norm(x.contiguous(), self.inner.norm)

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self.invariant:
            return rms_norm(x, norm.weight, norm.variance_epsilon)
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

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
        cos, sin = self._rotary(x, start + offsets)  # [1, n, D]
        layers = self.layers[:depth]
        if self.invariant:
            return self._native_layers(x, start, cos[0].contiguous(), sin[0].contiguous(), layers, hidden_layers,
                                       tree)
        return self._torch_layers(x, start, cos, sin, layers, hidden_layers, tree)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos and sin ([1, n, D] each) at `positions` [n] (a host tensor),
        read from a table of every position up to twice the furthest asked (the module's own
        values: a position's angles are its own products, whatever else is computed beside
        them), so a one-token step does not run the module; a rope that rescales with the
        length (dynamic, longrope) runs it every time."""
        rotary, end = self.inner.rotary_emb, int(positions.max()) + 1
        kind = getattr(rotary, "rope_type", "")
        if "dynamic" in kind or kind == "longrope":
            return rotary(x, positions.to(self.device).view(1, -1))
        if self._rope is None or end > self._rope[0].shape[1] or self._rope[0].dtype != x.dtype:
            self._rope = rotary(x, torch.arange(max(INITIAL_CAPACITY, 2 * end), device=self.device).view(1, -1))
        at = positions.to(self.device)
        return self._rope[0][:, at], self._rope[1][:, at]

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
        residual stream is updated in place, each update fused with the next norm."""
        hidden = {0: x} if 0 in hidden_layers else {}
        x = x[0].contiguous().clone()  # [n, H]: the residual stream, owned here
        table = self._native_table() if self.whole_layers_in_c else None
        if table is not None:  # the same kernels in one C call per run of layers
            first = 0
            for end in sorted({layer for layer in hidden_layers if 0 < layer <= len(layers)} | {len(layers)}):
                if end > first:
                    table.run(x, start, first, end - first, self.heads, self.keys, self.values, cos, sin, tree)
                if end in hidden_layers:
                    hidden[end] = x.clone()[None]
                first = end
            return x[None], hidden
        pending = None  # the last MLP's output, not yet added to x
        for i, layer in enumerate(layers):
            norm1, norm2 = layer.norm1, layer.norm2
            h = rms_norm(x, norm1.weight, norm1.variance_epsilon) if pending is None else \
                add_rms_norm(x, pending, norm1.weight, norm1.variance_epsilon)
            attended = attention_block(layer.qkv(h), cos, sin, self.keys[i][0], self.values[i][0], start, self.heads,
                                       tree, layer.qk_norm())
            h = add_rms_norm(x, layer.out(attended), norm2.weight, norm2.variance_epsilon)
            pending = layer.down(swiglu(layer.gate_up(h)))
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
        """`layers_over` in torch ops, SDPA attention (a drafter's forward)."""
        n = x.shape[1]
        end = start + n
        hidden = {0: x} if 0 in hidden_layers else {}
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, n, D]
        half = dim // 2
        # One new token attends to everything cached: no mask. A block attends causally, a
        # tree's row its own path.
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        if tree is not None:
            mask[:, start:] = ancestry(tree).to(self.device)
        for i, layer in enumerate(layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.norm1.weight, layer.norm1.variance_epsilon)
            q, k, v = layer.qkv(h).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q, k = q.view(1, n, heads, dim), k.view(1, n, kv_heads, dim)
            if layer.q_norm is not None:
                q_weight, k_weight, eps = layer.qk_norm()
                q, k = F.rms_norm(q, (dim,), q_weight, eps), F.rms_norm(k, (dim,), k_weight, eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            keys, values = self.keys[i], self.values[i]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v.view(1, n, kv_heads, dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                                      enable_gqa=heads != kv_heads)
            x = x + layer.out(attended.transpose(1, 2).reshape(1, n, heads * dim))
            h = F.rms_norm(x, (x.shape[-1],), layer.norm2.weight, layer.norm2.variance_epsilon)
            gate, up = layer.gate_up(h).split([layer.inner, layer.inner], dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        return x, hidden


def _invariant_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if device.type != "cpu" or dtype != torch.float32 or head_dim % 8 or head_dim > 256:
        return False
    from specdraft.models.kernels.native import kernel_problem

    return kernel_problem() is None


def lean_choice(core: str, model: nn.Module, device: torch.device, stack: bool = False) -> bool:
    """Whether a drafter's model runs the lean forward under `[decode] drafter_core`: "auto"
    on a CPU when the model allows it, "lean" wherever it does (a model it cannot run says
    why in the log and runs through transformers), "transformers" never. `stack`: `model`
    is a bare decoder stack fed embeddings (a draft head's layer)."""
    if core == "transformers" or (core == "auto" and device.type != "cpu"):
        return False
    problem = stack_problem(model) if stack else lean_problem(model)
    if problem is not None:
        name = "a draft head" if stack else type(model).__name__
        (log.warning if core == "lean" else log.debug)("%s runs through transformers: %s", name, problem)
    return problem is None
