"""Drafter kinds behind one interface (base.py), one file per kind, and the registry that
builds a pool from the profile (registry.py)."""

from specdraft.drafters.base import Draft, DraftContext, Drafter, PoolContext, TrajectoryScores
from specdraft.drafters.layers import LayersDrafter, truncated_view
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.drafters.none import PlainDecoding

__all__ = ["Draft", "DraftContext", "Drafter", "PoolContext", "TrajectoryScores", "PlainDecoding", "ModelDrafter",
           "NgramDrafter", "LayersDrafter", "truncated_view"]
