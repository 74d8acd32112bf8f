"""Drafter kinds and the factory that builds a pool from the profile."""

from specdraft.drafters.base import Draft, DraftContext, Drafter, PlainDecoding
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter

__all__ = ["Draft", "DraftContext", "Drafter", "PlainDecoding", "ModelDrafter", "NgramDrafter"]
