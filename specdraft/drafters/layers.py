"""The `layers` self-drafter: the target's first k decoder layers, its final norm and its
head, sharing the target's weights and the target's own KV cache (ARCHITECTURE.md,
"Drafter kinds").

The view is a shallow copy of the target module whose config says k layers. Transformers'
decoder loops over `layers[: config.num_hidden_layers]` and sizes masks from the config, so
the copy runs the same code path on a prefix of the same weights. Its KV for the committed
positions is exactly the target's KV in layers < k, so drafting runs over the target's
cache (no second cache, no catch-up forward) and gives the draft positions back before the
verify writes them. Full-information scoring needs no forward at all: the verify hands over
the target's hidden state after layer k at the committed positions, and the drafter's
distribution there is one norm and one head projection.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace
from typing import Sequence

import torch

from specdraft.core.sampling import distributions
from specdraft.core.verify import overlap
from specdraft.drafters.base import DraftContext, Hidden, PoolContext
from specdraft.drafters.model_base import CausalLMDrafter
from specdraft.drafters.options import LayersOptions
from specdraft.errors import ProfileError
from specdraft.models.cached_lm import CachedLM, fit_logits
from specdraft.models.kv_cache import cache_keyword


class TargetPrefix:
    """The view run over the target's KV cache: it appends draft positions to layers < k
    and `release()` removes them again, so the target's cache is untouched for the verify."""

    def __init__(self, target: CachedLM, view: torch.nn.Module, layers: int, logits_size: int):
        self.target, self.model, self.layers, self.logits_size = target, view, layers, logits_size
        self.device = target.device
        self.clock = target.clock
        self.extra = 0  # positions written beyond the target's own length

    @property
    def length(self) -> int:
        return self.target.length + self.extra

    def reset(self) -> None:
        self.extra = 0  # the target resets the cache itself

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        n = tokens.shape[-1]
        if self.target.lean is not None:  # the target's own buffer: later feeds overwrite these positions
            logits = self.target.prefix_logits(tokens, self.length, keep, self.layers)
            self.extra += n
            return fit_logits(logits, self.logits_size)
        self.target.reserve(self.length + n)
        positions = torch.arange(self.length, self.length + n, device=self.device)
        out = self.model(input_ids=tokens.view(1, n).to(self.device), position_ids=positions.view(1, n),
                         use_cache=True, logits_to_keep=keep, **{cache_keyword(self.model): self.target.cache})
        self.extra += n
        return fit_logits(out.logits[0], self.logits_size)

    def crop(self, length: int) -> None:
        self._remove(self.extra - max(0, length - self.target.length))

    def release(self) -> None:
        self._remove(self.extra)

    def _remove(self, count: int) -> None:
        if count > 0:
            if self.target.kv is not None:
                self.target.kv.remove_last(count, layers=self.layers, length=self.length)
            self.extra -= count

    @torch.inference_mode()
    def uncached_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        return fit_logits(self.model(ids).logits[0], self.logits_size)


class LayersDrafter(CausalLMDrafter):
    kind = "layers"
    lm: TargetPrefix

    def __init__(self, name: str, ctx: DraftContext, target: CachedLM, layers: int, stop_below: float | None = None):
        view = truncated_view(target.model, layers)
        super().__init__(name, ctx, TargetPrefix(target, view, layers, ctx.vocab_size), stop_below)
        self.layers = layers
        self._softcap = getattr(view.config, "final_logit_softcapping", None)

    @classmethod
    def build(cls, name: str, options: LayersOptions, pool: PoolContext, key: str, index: int) -> "LayersDrafter":
        try:
            return cls(name, pool.draft, pool.target_lm, options.layers, options.stop_below)
        except ValueError as exc:
            raise ProfileError(pool.file, f"{key}.layers", str(exc)) from None

    traits = replace(CausalLMDrafter.traits, scored_by_own_forward=False)  # scored from the verify's hidden states

    @torch.inference_mode()
    def forward_seconds(self, widths: Sequence[int], repeats: int) -> dict[int, float]:
        """Its forward (the target's first layers, norm and head) over n tokens after 64
        cached ones, on a twin of the target's cache (it has no cache of its own to time)."""
        target = self.lm.target.twin()
        prefix = TargetPrefix(target, self.lm.model, self.layers, self.lm.logits_size)
        target.feed(torch.arange(3, 67, device=target.device) % 100, keep=1)
        samples: dict[int, list[float]] = {w: [] for w in widths}
        for attempt in range(repeats + 1):  # the first pass warms up
            for width in widths:
                tokens = torch.full((width,), 5, dtype=torch.long, device=target.device)
                started = target.clock()
                prefix.feed(tokens, keep=1)
                elapsed = target.clock() - started
                prefix.release()
                if attempt:
                    samples[width].append(elapsed)
        return {w: statistics.median(s) for w, s in samples.items()}

    def prepare_scoring(self, context: Sequence[int]) -> None:
        """Nothing to prefill: its cache is the target's, and it is scored from the verify's
        hidden states."""

    def _end_draft(self, context: Sequence[int], fed: int) -> None:
        self.lm.release()  # the verify recomputes these positions in every layer

    def _keep(self, n_accepted: int) -> None:
        """Nothing to roll back: the draft positions left the target's cache in `_end_draft`."""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.layers,)

    @torch.inference_mode()
    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        if hidden is None or self.layers not in hidden:
            raise ValueError(f"the layers drafter {self.name!r} is scored from the target's layer-{self.layers} "
                             "hidden states, and none were handed over")
        states = hidden[self.layers][:count]
        view = self.lm.model
        logits = view.lm_head(view.model.norm(states))
        if self._softcap:  # models that cap their logits (Gemma) do it after the head
            logits = torch.tanh(logits / self._softcap) * self._softcap
        logits = fit_logits(logits, self.ctx.vocab_size)
        return overlap(target_probs, distributions(logits, self.ctx.params).to(target_probs.device))


def truncated_view(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A module that runs the target's first `layers` decoder layers; ValueError when impossible."""
    inner = getattr(target, "model", None)
    decoder_layers = getattr(inner, "layers", None)
    if not isinstance(decoder_layers, torch.nn.ModuleList):
        raise ValueError(f"{type(target).__name__} has no `model.layers`: layers drafters need a decoder-only model")
    total = len(decoder_layers)
    if not 1 <= layers < total:
        raise ValueError(f"must be between 1 and {total - 1}: the target has {total} decoder layers")

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:layers])

    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)  # never mutate the target's module table
    view_inner.layers = torch.nn.ModuleList(list(decoder_layers[:layers]))
    view_inner.config = config
    view = copy.copy(target)
    view._modules = dict(target._modules)
    view.model = view_inner
    view.config = config
    return view
