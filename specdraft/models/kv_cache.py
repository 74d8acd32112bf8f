"""The two KV caches a CachedLM can hold, behind one small interface.

- dynamic (transformers' DynamicCache): grows by concatenation, rolls back by slicing. The
  CPU default: nothing is allocated that is not used. Sliding-window layers record their
  past states, so a rollback after the window filled still has what it needs.
- static (transformers' StaticCache): every layer's keys and values are allocated once, at
  a capacity, and written in place at a device-side position counter. Rolling back is a
  position reset: entries past the position are masked (queries attend causally by their
  position ids) and overwritten by the next write. Its buffers never move, which is what
  lets a forward be captured once as a CUDA graph and replayed (cuda_graphs.py). When a
  context outgrows the capacity, the cache is reallocated at twice the size and copied.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Sequence

import torch

log = logging.getLogger("specdraft")

STATIC_CAPACITY = 2048  # tokens; doubled when a context needs more


class KVCache:
    """A transformers cache plus what rolling it back and growing it take."""

    static = False

    def __init__(self, config: Any):
        self.config = config
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache  # here, so that importing this module stays light

        self.cache = DynamicCache(config=self.config)
        # Sliding-window layers drop what falls out of the window at every update, so a
        # rollback past it would fail; recording keeps those states until the next crop.
        self.cache.activate_past_recording()

    def ensure_capacity(self, length: int) -> bool:
        """Make room for `length` tokens; True when the buffers moved (graphs are stale)."""
        return False

    def remove_last(self, count: int, layers: int | None = None, length: int | None = None) -> None:
        """Forget the last `count` tokens of the first `layers` layers (all when None).
        `length` is the current length, which the static cache needs."""
        for layer in self.cache.layers[:layers]:
            layer.crop(-count)  # transformers 5: a layer's crop takes the number of tokens to remove

    @property
    def sliding(self) -> bool:
        """Whether some layer keeps a sliding window (its entries are not one per position)."""
        return any("Sliding" in type(layer).__name__ for layer in self.cache.layers)

    @torch.inference_mode()
    def keep_rows(self, start: int, rows: Sequence[int], length: int) -> None:
        """After a token tree written at start.. (the cache `length` long): rows `rows` become
        positions start, start + 1, .. in every layer, and the rest is forgotten."""
        # keys and values [batch, heads, positions, dim]
        move_path([b for layer in self.cache.layers for b in (layer.keys, layer.values)], 2, start, rows)
        self.remove_last(length - start - len(rows), length=length)


def move_path(buffers: Sequence[torch.Tensor], dim: int, start: int, rows: Sequence[int]) -> None:
    """A token tree's accepted path into place: in each buffer, the slot start + rows[d]
    along `dim` moves to start + d (lean buffers and transformers' caches alike)."""
    moved = [(start + row, start + depth) for depth, row in enumerate(rows) if row != depth]
    if not moved:
        return
    sources, targets = zip(*moved)
    indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per device, not per buffer
    for buffer in buffers:
        if buffer.device not in indices:
            indices[buffer.device] = tuple(torch.tensor(side, device=buffer.device) for side in (sources, targets))
        source, target = indices[buffer.device]
        buffer.index_copy_(dim, target, buffer.index_select(dim, source))


class StaticKVCache(KVCache):
    static = True

    def __init__(self, config: Any, capacity: int | None = None):
        from transformers import StaticCache

        self.config = config
        self.capacity = capacity = capacity or STATIC_CAPACITY
        self.cache = StaticCache(config=config, max_cache_len=capacity)

    def reset(self) -> None:
        self._set_position(0, None)  # buffers stay where they are: captured graphs stay valid

    @torch.inference_mode()  # the buffers are inference tensors: forwards create them
    def ensure_capacity(self, length: int) -> bool:
        if length <= self.capacity:
            return False
        from transformers import StaticCache

        old, capacity = self.cache, self.capacity
        while capacity < length:
            capacity *= 2
        self.cache, self.capacity = StaticCache(config=self.config, max_cache_len=capacity), capacity
        for new_layer, old_layer in zip(self.cache.layers, old.layers):
            if not old_layer.is_initialized:
                continue
            new_layer.lazy_initialization(old_layer.keys[:, :, :1], old_layer.values[:, :, :1])
            new_layer.keys[:, :, : old_layer.max_cache_len].copy_(old_layer.keys)
            new_layer.values[:, :, : old_layer.max_cache_len].copy_(old_layer.values)
            new_layer.cumulative_length.copy_(old_layer.cumulative_length)
        return True

    def remove_last(self, count: int, layers: int | None = None, length: int | None = None) -> None:
        if length is None:
            raise ValueError("a static cache rolls back to a position: give the current length")
        self._set_position(length - count, layers)

    @torch.inference_mode()
    def _set_position(self, position: int, layers: int | None) -> None:
        for layer in self.cache.layers[:layers]:
            if layer.is_initialized:
                layer.cumulative_length.fill_(position)  # in place: its address is in captured graphs
            else:
                layer.cumulative_length = torch.tensor(position, dtype=torch.long)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from about
    transformers 5.2x on (there `past_key_values` is a deprecated alias, to be removed in
    5.40), `past_key_values` in earlier 5.x releases and in remote code that kept it."""
    return _cache_keyword(type(model))


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def new_kv_cache(model: torch.nn.Module, static: bool) -> KVCache:
    """A static cache when asked and the model's layers allow it, else a dynamic one."""
    if static:
        problem = static_cache_problem(model)
        if problem is None:
            return StaticKVCache(model.config)
        log.info("%s: using the dynamic KV cache (%s)", type(model).__name__, problem)
    return KVCache(model.config)


def static_cache_problem(model: torch.nn.Module) -> str | None:
    """Why a position reset cannot roll this model's static cache back, or None. Sliding-
    window layers keep a host-side length and roll their buffers; linear-attention and
    recurrent layers keep state a position does not describe."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    kinds = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=8).layers
             if type(layer) is not StaticLayer}
    return f"it has {', '.join(sorted(kinds))} layers" if kinds else None


def core_choice(kv_cache: str, cuda_graphs: bool, device: torch.device) -> tuple[bool, bool]:
    """(static cache, CUDA graphs) for a model on `device` from `[decode] kv_cache` and
    `cuda_graphs`: "auto" is static on CUDA (graphs need it) and dynamic elsewhere
    (a CPU gains nothing from preallocating); graphs only ever on CUDA."""
    static = kv_cache == "static" or (kv_cache == "auto" and device.type == "cuda")
    return static, static and cuda_graphs and device.type == "cuda"
