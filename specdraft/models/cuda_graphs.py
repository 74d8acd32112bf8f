"""Forwards captured once as CUDA graphs and replayed: the launch overhead of a small step.

A decode step of a small model is hundreds of tiny kernels; on a GPU their launches, not
their arithmetic, set its cost, so a 68M drafter would cost nearly what the target costs.
A CUDA graph records the kernels of one forward once and replays them with one launch.
That needs every tensor the forward touches to stay where it was: the inputs are copied
into fixed buffers, the KV cache is static (kv_cache.py: a rollback is a position reset)
and the outputs are read from the buffers the capture produced.

One graph per distinct call shape (width, logits kept, hidden layers, chain or token tree): a
round uses the verify width K+1 for the few K the policy picks, a tree round one graph per
tree size (its attention mask, which says which rows each row sees, is an input buffer like
the token ids and positions), and drafters step one token at a time.
A width is run eagerly the first time (warming up kernels and allocator), captured the
second time, replayed from then on. If a capture fails (a model whose forward syncs with
the host), graphs are switched off for that model with one warning and it runs eagerly.

The capture itself is injected (`capture`): CUDA's on a GPU, which records the kernels
without running them (the cache is untouched until the first replay); tests on a CPU pass
one that replays by re-running the forward on the same buffers, which checks everything
here but the driver call.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("specdraft")

MAX_GRAPH_WIDTH = 16  # wider feeds (prefills, long catch-ups) run eagerly
Outputs = tuple[torch.Tensor, dict[int, torch.Tensor]]
# (ids [1, w], positions [1, w], logits to keep, hidden layers, a token tree's attention mask
# [1, 1, w, cache capacity] or None for a chain) -> (logits, {layer: hidden})
Forward = Callable[[torch.Tensor, torch.Tensor, int, Sequence[int], torch.Tensor | None], Outputs]
Capture = Callable[[Callable[[], Outputs]], tuple[Callable[[], None], Outputs]]


def cuda_capture(device: torch.device) -> Capture:
    # On the model's own device: torch's default capture stream and pool belong to whichever
    # device was current, and kernels of a model on cuda:1 would run, uncaptured, beside it.
    with torch.cuda.device(device):
        pool = torch.cuda.graph_pool_handle()  # one memory pool shared by all widths of a model
        stream = torch.cuda.Stream(device)

    def capture(run: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        graph = torch.cuda.CUDAGraph()
        # A model's graphs sit in a reference cycle (their forward is a bound method of the
        # CachedLM that owns them), so a dropped model's graphs are freed by Python's cyclic
        # collector, whenever it runs; a graph freed while another is being captured ends
        # that capture ("operation not permitted when stream is capturing").
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(device):
                torch.cuda.synchronize(device)
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = run()
        finally:
            if collecting:
                gc.enable()
        return graph.replay, outputs

    return capture


class GraphedForward:
    """Runs `forward` through one captured graph per call shape."""

    def __init__(self, forward: Forward, device: torch.device, capture: Capture | None = None,
                 max_width: int = MAX_GRAPH_WIDTH):
        self.forward = forward
        self.device = device
        self.injected = capture
        self.max_width = max_width
        self.enabled = True
        self.clear()

    def clear(self) -> None:
        """Forget every graph (the KV buffers moved). CUDA's capture starts a memory pool of
        its own: the old pool is released with the last graph that used it, and capturing
        into a released pool fails inside torch's allocator."""
        self.capture = self.injected or cuda_capture(self.device)
        self.graphs: dict[tuple, tuple[Callable[[], None], Outputs, torch.Tensor, torch.Tensor,
                                       torch.Tensor | None]] = {}
        self.seen: set[tuple] = set()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: int, layers: Sequence[int],
                 mask: torch.Tensor | None = None) -> Outputs | None:
        """The forward's outputs for these inputs (`mask`: a token tree's attention mask),
        or None when this call runs eagerly (the caller then calls the model itself)."""
        width = ids.shape[-1]
        if not self.enabled or width > self.max_width:
            return None
        key = (width, keep, tuple(layers), None if mask is None else tuple(mask.shape))
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)  # first time: eager, which warms this shape up
                return None
            if not self._capture(key, width, keep, layers, mask):
                return None
        replay, outputs, ids_buffer, positions_buffer, mask_buffer = self.graphs[key]
        ids_buffer.copy_(ids.view(1, width))
        positions_buffer.copy_(positions.view(1, width))
        if mask_buffer is not None:
            mask_buffer.copy_(mask)
        replay()
        logits, hidden = outputs
        # The buffers are overwritten by the next replay; callers may keep what they get.
        return logits.clone(), {layer: h.clone() for layer, h in hidden.items()}

    def _capture(self, key: tuple, width: int, keep: int, layers: Sequence[int], mask: torch.Tensor | None) -> bool:
        ids_buffer = torch.zeros(1, width, dtype=torch.long, device=self.device)
        positions_buffer = torch.zeros(1, width, dtype=torch.long, device=self.device)
        mask_buffer = None if mask is None else mask.clone()
        try:
            replay, outputs = self.capture(lambda: self.forward(ids_buffer, positions_buffer, keep, layers, mask_buffer))
        except Exception as exc:  # noqa: BLE001 - any failure means: run this model eagerly
            self.enabled = False
            log.warning("CUDA graphs are off for this model: capturing its forward failed (%s)",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return False
        self.graphs[key] = (replay, outputs, ids_buffer, positions_buffer, mask_buffer)
        return True
