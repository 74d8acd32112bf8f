"""The `layers` self-drafter: the target's first k decoder layers, its final norm and its
head, sharing the target's weights (no extra parameter memory) with a KV cache of its own.

It is a shallow copy of the target module whose config says k layers. Transformers'
decoder loops over `layers[: config.num_hidden_layers]` and sizes caches and masks from
the config, so the copy runs the same code path on a prefix of the same weights.
"""

from __future__ import annotations

import copy

import torch

from specdraft.errors import ProfileError


def truncated_view(target: torch.nn.Module, layers: int, where: tuple[str, str]) -> torch.nn.Module:
    """A module that runs the target's first `layers` decoder layers; `where` = (file, key) for errors."""
    inner = getattr(target, "model", None)
    decoder_layers = getattr(inner, "layers", None)
    if not isinstance(decoder_layers, torch.nn.ModuleList):
        raise ProfileError(*where, f"{type(target).__name__} has no `model.layers`: layers drafters need a decoder-only model")
    total = len(decoder_layers)
    if not 1 <= layers < total:
        raise ProfileError(*where, f"must be between 1 and {total - 1}: the target has {total} decoder layers")

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
