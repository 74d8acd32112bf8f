"""Each drafter kind's profile keys: what a `[[drafters]]` table of that kind may say,
checked with key paths, into a frozen options object the kind's `build` takes.

Torch-free on purpose (like the rest of the profile parser): a mistake in a profile is
reported before torch or transformers load, in a fraction of a second. The kind classes
(`ngram.py`, `model.py`, `layers.py`, `suffix.py`, `head.py`, `steered.py`) point at these parsers; `registry.py` maps kind
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


@dataclass(frozen=True)
class SuffixOptions:
    prompt: bool = True  # match the current prompt and output
    history: bool = True  # match earlier prompts and outputs of this process
    store: Path | None = None  # a datastore from `specdraft datastore build`
    learn: bool = False  # grow a store under the cache folder across runs, and match it
    learn_max_tokens: int = 5_000_000  # the learned store's bound; the oldest text goes first
    max_match: int = 32  # longest context suffix matched (also the index depth of learned text)
    min_match: int = 1
    min_prob: float = 0.1  # stop once the draft's estimated chance of surviving falls below
    spec_factor: float = 4.0  # draft at most this many tokens per matched token
    # 1: the most frequent continuation. 2..4: the one that starts with the 2nd..4th most
    # frequent next token (and then follows the most frequent), a token tree's branch
    # beside rank 1's chain where the text went one of several ways before.
    rank: int = 1


@dataclass(frozen=True)
class HeadOptions:
    path: Path  # the folder `specdraft train head --out` wrote
    stop_below: float | None = None
    optional: bool = False  # a missing head folder leaves the drafter out of the pool (with a warning)


@dataclass(frozen=True)
class SteeredOptions:
    model: ModelSpec  # the pretrained drafter (same keys as [target])
    steering: Path  # the folder `specdraft train steer --out` wrote
    stop_below: float | None = None
    optional: bool = False  # a missing steering folder leaves the drafter out of the pool (with a warning)


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


MAX_RANK = 4


def parse_suffix(table: Table, base: Path) -> SuffixOptions:
    defaults = SuffixOptions()
    flags = {key: table.get(key, bool, getattr(defaults, key)) for key in ("prompt", "history", "learn")}
    store = table.get("store", str)
    store_path = None
    if store is not None:
        if not store:
            raise table.error("store", "is empty; give the folder `specdraft datastore build --out` wrote")
        store_path = Path(store).expanduser()
        store_path = store_path if store_path.is_absolute() else base / store_path
    if not (flags["prompt"] or flags["history"] or flags["learn"] or store_path):
        raise table.error("prompt", "every source is off (prompt, history, learn, store): nothing to draft from")
    learn_max = table.get("learn_max_tokens", int, defaults.learn_max_tokens)
    if learn_max < 1000:
        raise table.error("learn_max_tokens", f"must be at least 1000 (got {learn_max})")
    max_match = table.get("max_match", int, defaults.max_match)
    if not 1 <= max_match <= 256:
        raise table.error("max_match", f"must be in 1..256 (got {max_match})")
    min_match = table.get("min_match", int, defaults.min_match)
    if not 1 <= min_match <= max_match:
        raise table.error("min_match", f"must be in 1..max_match = {max_match} (got {min_match})")
    min_prob = float(table.get("min_prob", (float, int), defaults.min_prob))
    if not 0 <= min_prob < 1:
        raise table.error("min_prob", f"must be in [0, 1) (got {min_prob})")
    spec_factor = float(table.get("spec_factor", (float, int), defaults.spec_factor))
    if spec_factor <= 0:
        raise table.error("spec_factor", f"must be positive (got {spec_factor})")
    rank = table.get("rank", int, defaults.rank)
    if not 1 <= rank <= MAX_RANK:
        raise table.error("rank", f"must be in 1..{MAX_RANK} (got {rank})")
    table.finish()
    return SuffixOptions(flags["prompt"], flags["history"], store_path, flags["learn"], learn_max, max_match,
                         min_match, min_prob, spec_factor, rank)


def parse_head(table: Table, base: Path) -> HeadOptions:
    path = table.get("path", str)
    if not path:
        raise table.error("path", "missing; the folder `specdraft train head --out` wrote")
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else base / folder
    stop_below = _stop_below(table)
    optional = table.get("optional", bool, False)
    table.finish()
    return HeadOptions(folder, stop_below, optional)


def parse_steered(table: Table, base: Path) -> SteeredOptions:
    spec = parse_model_spec(table.subset(MODEL_KEYS), base)
    path = table.get("steering", str)
    if not path:
        raise table.error("steering", "missing; the folder `specdraft train steer --out` wrote")
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else base / folder
    stop_below = _stop_below(table)
    optional = table.get("optional", bool, False)
    table.finish()
    return SteeredOptions(spec, folder, stop_below, optional)


def _stop_below(table: Table) -> float | None:
    """`stop_below`: a fixed confidence under which drafting stops; absent = learned."""
    value = table.get("stop_below", (float, int))
    if value is not None and not 0 <= value < 1:
        raise table.error("stop_below", f"must be in [0, 1) (got {value})")
    return None if value is None else float(value)


# kind name -> its parser; the classes behind the names are in registry.py
PARSERS = {"model": parse_model, "ngram": parse_ngram, "layers": parse_layers, "suffix": parse_suffix,
           "head": parse_head, "steered": parse_steered}
