"""The `layers` self-drafter: the target's first k decoder layers, its final norm and its
head, sharing the target's weights (no extra parameter memory) with a KV cache of its own.

It is a shallow copy of the target module whose config says k layers. Transformers'
decoder loops over `layers[: config.num_hidden_layers]` and sizes caches and masks from
the config, so the copy runs the same code path on a prefix of the same weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.config.tables import Table
from specdraft.drafters.base import PoolContext
from specdraft.drafters.model import ModelDrafter
from specdraft.errors import ProfileError


@dataclass(frozen=True)
class LayersOptions:
    layers: int


class LayersDrafter(ModelDrafter):
    kind = "layers"

    @classmethod
    def parse_options(cls, table: Table, base: Path) -> LayersOptions:
        layers = table.get("layers", int)
        if layers is None:
            raise table.error("layers", "missing; how many of the target's first decoder layers to use")
        if layers < 1:
            raise table.error("layers", f"must be at least 1 (got {layers})")
        table.finish()
        return LayersOptions(layers)

    @classmethod
    def build(cls, name: str, options: LayersOptions, pool: PoolContext, key: str) -> "LayersDrafter":
        try:
            view = truncated_view(pool.target.model, options.layers)
        except ValueError as exc:
            raise ProfileError(pool.file, f"{key}.layers", str(exc)) from None
        return cls(name, pool.draft, view)


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
