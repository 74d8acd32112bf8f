"""Drafter kinds behind one interface (base.py), the bases kinds share (lookup_base.py,
model_base.py), one file per kind, their profile keys (options.py, torch-free) and the
registry that builds a pool from the profile (registry.py). Names below load on first
use, so that parsing a profile (which imports registry.py) never imports torch."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Draft": "base", "DraftContext": "base", "Drafter": "base", "PoolContext": "base", "TrajectoryScores": "base",
    "PlainDecoding": "none", "ModelDrafter": "model", "NgramDrafter": "ngram", "LayersDrafter": "layers",
    "SuffixDrafter": "suffix", "LookupDrafter": "lookup_base", "ModelBackedDrafter": "model_base",
    "CausalLMDrafter": "model_base", "DraftLM": "model_base",
    "truncated_view": "layers",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
