"""Each drafter kind's profile keys: what a `[[drafters]]` table of that kind may say,
checked with key paths, into a frozen options object the kind's `build` takes.

Torch-free on purpose (like the rest of the profile parser): a mistake in a profile is
reported before torch or transformers load, in a fraction of a second. The kind classes
(`ngram.py`, `model.py`, `layers.py`) point at these parsers; `registry.py` maps kind
names to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdraft.config.model_spec import MODEL_KEYS, ModelSpec, parse_model_spec
from specdraft.config.tables import Table


@dataclass(frozen=True)
class NgramOptions:
    min_ngram: int = 1
    max_ngram: int = 3


@dataclass(frozen=True)
class ModelOptions:
    model: ModelSpec
    stop_below: float | None = None  # a fixed confidence floor; None = learned


@dataclass(frozen=True)
class LayersOptions:
    layers: int
    stop_below: float | None = None


def parse_ngram(table: Table, base: Path) -> NgramOptions:
    min_n, max_n = table.get("min_ngram", int, 1), table.get("max_ngram", int, 3)
    if min_n < 1:
        raise table.error("min_ngram", f"must be at least 1 (got {min_n})")
    if max_n < min_n:
        raise table.error("max_ngram", f"must be at least min_ngram = {min_n} (got {max_n})")
    table.finish()
    return NgramOptions(min_n, max_n)


def parse_model(table: Table, base: Path) -> ModelOptions:
    spec = parse_model_spec(table.subset(MODEL_KEYS), base)
    stop_below = _stop_below(table)
    table.finish()
    return ModelOptions(spec, stop_below)


def parse_layers(table: Table, base: Path) -> LayersOptions:
    layers = table.get("layers", int)
    if layers is None:
        raise table.error("layers", "missing; how many of the target's first decoder layers to use")
    if layers < 1:
        raise table.error("layers", f"must be at least 1 (got {layers})")
    stop_below = _stop_below(table)
    table.finish()
    return LayersOptions(layers, stop_below)


def _stop_below(table: Table) -> float | None:
    """`stop_below`: a fixed confidence under which drafting stops; absent = learned."""
    value = table.get("stop_below", (float, int))
    if value is not None and not 0 <= value < 1:
        raise table.error("stop_below", f"must be in [0, 1) (got {value})")
    return None if value is None else float(value)


# kind name -> its parser; the classes behind the names are in registry.py
PARSERS = {"model": parse_model, "ngram": parse_ngram, "layers": parse_layers}
