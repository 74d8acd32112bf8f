"""CachedLM: a causal language model together with its own KV cache and position.

Every model in a round (the target and each model-backed drafter) is one of these. It
knows how many tokens its cache holds, feeds new tokens at the right positions, and crops
back to a shorter length so that rejected draft tokens leave no trace. The cache is
dynamic or static (kv_cache.py); over a static cache on a GPU, small feeds replay CUDA
graphs (cuda_graphs.py). Every combination gives the same logits. A drafter on a CPU may
instead run the lean forward over a KV buffer of its own (lean/decoder.py): the same
logits up to float rounding, without transformers' per-op overhead.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.core.stopwatch import device_clock
from specdraft.models.cuda_graphs import Capture, GraphedForward, Outputs
from specdraft.models.kv_cache import cache_keyword, new_kv_cache
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.lean.tree_rows import ancestry, tree_depths, tree_rows


class CachedLM:
    def __init__(self, model: torch.nn.Module, logits_size: int | None = None, static: bool = False,
                 graphs: bool = False, capture: Capture | None = None, lean: bool = False):
        """`static`: a preallocated KV cache; `graphs`: replay small feeds as CUDA graphs
        (needs the static cache; `capture` replaces CUDA's, for tests); `lean`: feed through
        the lean forward over a KV buffer of its own (no transformers cache: a `layers`
        self-drafter then runs the buffer's first layers through `prefix_logits`)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.clock = device_clock(self.device)  # waits for the GPU: what it reads is real work
        # Pad or cut this model's logits to the target's width so that p and q line up.
        self.logits_size = logits_size
        # Seconds spent in forwards, kept only when `timed` (benchmarks' overhead accounting):
        # on a GPU each reading waits for the device, which would stall a draft loop.
        self.timed = False
        self.forward_seconds = 0.0
        self.lean = LeanDecoder(model) if lean else None
        self.kv = None if lean else new_kv_cache(model, static)
        # graphs need buffers that never move: only over a static cache (which a model with
        # sliding-window layers does not get)
        self.graphs = (GraphedForward(self.eager_forward, self.device, capture)
                       if graphs and self.kv is not None and self.kv.static else None)
        self.length = 0
        self.tree_start = 0  # where the last token tree was fed (feed_tree, keep_path)
        self.resets = 0  # how often the cache was emptied: a holder of its prefix checks this

    def twin(self) -> "CachedLM":
        """The same model with a fresh cache of the same kind (for timing it apart)."""
        return CachedLM(self.model, self.logits_size, static=self.kv is not None and self.kv.static,
                        graphs=self.graphs is not None, lean=self.lean is not None)

    @property
    def cache(self):
        """The transformers cache object (drafters that run a view of this model write into it)."""
        if self.kv is None:
            raise RuntimeError("a model fed through the lean forward has no transformers cache")
        return self.kv.cache

    def reset(self) -> None:
        if self.kv is not None:  # the lean buffer is simply written from position 0 again
            self.kv.reset()
        self.length = 0
        self.resets += 1

    def reserve(self, length: int) -> None:
        """Room in the cache for `length` tokens (a static cache grows when it must)."""
        if self.kv is not None and self.kv.ensure_capacity(length) and self.graphs is not None:
            self.graphs.clear()  # the static buffers moved: captured graphs point at the old ones

    def feed(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Consume `tokens` [n] and return the logits of the last `keep` positions [keep, V]
        (keep = 0 returns all n). Each row predicts the token after its position."""
        return self.feed_with_hidden(tokens, keep, ())[0]

    @torch.inference_mode()
    def feed_with_hidden(self, tokens: torch.Tensor, keep: int, layers: Sequence[int]
                         ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`feed`, also returning the hidden state after each of `layers` decoder layers at
        every position of `tokens` ({layer: [n, H]}, pre final norm): what drafters that
        read the target's internals are scored from."""
        start = self.clock() if self.timed else 0.0
        n = tokens.shape[-1]
        if self.lean is not None:
            logits, hidden = self.lean.forward(tokens.to(self.device), self.length, keep, layers)
        else:
            self.reserve(self.length + n)
            ids = tokens.view(1, n).to(self.device)
            positions = torch.arange(self.length, self.length + n, device=self.device).view(1, n)
            outputs = self.graphs(ids, positions, keep, layers) if self.graphs is not None else None
            logits, hidden = outputs if outputs is not None else self.eager_forward(ids, positions, keep, layers)
        self.length += n
        if self.timed:
            self.forward_seconds += self.clock() - start
        return self._fit(logits), hidden

    @torch.inference_mode()
    def feed_tree(self, tokens: torch.Tensor, parents: Sequence[int], layers: Sequence[int] = ()
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Feed a token tree `tokens` [n] after the cache (`parents[i]` < i the row of token
        i's parent; row 0, the root, follows the cached text): the logits at every row [n, V]
        and the hidden states after `layers` ({layer: [n, H]}), each row as if its own path
        were fed as a chain (positions by depth, attention to the cached text and the row's
        own path). The cache then holds the whole tree until `keep_path`. A lean model's
        kernels give each row its path's logits bit for bit; through transformers (a 4D
        mask) they agree up to float rounding, as a chain verify does; over a static cache
        on CUDA a tree of each size replays a graph of its own."""
        start = self.clock() if self.timed else 0.0
        n = tokens.shape[-1]
        if self.lean is not None:
            logits, hidden = self.lean.forward(tokens.to(self.device), self.length, 0, layers, parents=parents)
        else:
            tree = tree_rows(parents, n)
            if self.kv.sliding:
                raise ValueError("a token tree cannot be fed to a model with sliding-window layers")
            self.reserve(self.length + n)
            width = self.kv.capacity if self.kv.static else self.length + n
            mask = torch.zeros(n, width, dtype=torch.bool)
            mask[:, : self.length] = True
            mask[:, self.length : self.length + n] = ancestry(tree)
            positions = (self.length + tree_depths(tree)).view(1, n).to(self.device)
            ids, mask = tokens.view(1, n).to(self.device), mask[None, None].to(self.device)
            outputs = self.graphs(ids, positions, 0, layers, mask) if self.graphs is not None else None
            logits, hidden = outputs if outputs is not None else self.eager_forward(ids, positions, 0, layers, mask)
        self.tree_start, self.length = self.length, self.length + n
        if self.timed:
            self.forward_seconds += self.clock() - start
        return self._fit(logits), hidden

    def keep_path(self, rows: Sequence[int]) -> None:
        """Keep only the root-to-node path `rows` (row 0 first) of the tree just fed: the
        cache then holds the text before the tree and that path, in order."""
        if self.lean is not None:
            self.lean.keep_path(self.tree_start, rows)
        else:
            self.kv.keep_rows(self.tree_start, rows, self.length)
        self.length = self.tree_start + len(rows)

    def eager_forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int, layers: Sequence[int],
                      mask: torch.Tensor | None = None) -> Outputs:
        """transformers' forward over the cache, with no captured graph (what a graph captures);
        `mask`: a token tree's 4D attention mask."""
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=keep, output_hidden_states=bool(layers),
                         **{cache_keyword(self.model): self.cache})
        return out.logits[0], {layer: out.hidden_states[layer][0] for layer in layers}

    @torch.inference_mode()
    def prefix_logits(self, tokens: torch.Tensor, start: int, keep: int, depth: int) -> torch.Tensor:
        """The first `depth` layers (then the final norm and head) over `tokens` [n] fed at
        `start` >= this model's length, through the lean buffer: logits of the last `keep`
        positions. Those positions of layers < depth are overwritten by the next feed."""
        return self._fit(self.lean.forward(tokens.to(self.device), start, keep, (), depth)[0])

    @torch.inference_mode()
    def uncached_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] at every position of `tokens` in one forward, leaving the cache alone
        (through the same forward as `feed`: a lean model's own arithmetic, in a buffer of its own)."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        if self.lean is not None:
            return self._fit(LeanDecoder(self.model).forward(ids[0], 0, 0)[0])
        return self._fit(self.model(ids).logits[0])

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens."""
        if length < self.length:
            if self.kv is not None:  # the lean buffer is overwritten from `length` by the next feed
                self.kv.remove_last(self.length - length, length=self.length)
            self.length = length

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_logits(logits, self.logits_size)


def fit_logits(logits: torch.Tensor, size: int | None) -> torch.Tensor:
    """Pad (with -inf) or cut `logits` [..., V] to width `size` (None: unchanged)."""
    if size is None or logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
