"""The drafter kinds a profile may name, and the pool factory: `[[drafters]]` tables in,
ready drafters out. The only place that maps kind names to classes.

Parsing a table needs only the kind's key parser (`options.py`, torch-free); the class,
and torch with it, is imported when a pool is built, so a profile validates in a blink.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from specdraft.config.tables import Table
from specdraft.drafters.options import PARSERS

if TYPE_CHECKING:
    from specdraft.drafters.base import Drafter, PoolContext

log = logging.getLogger("specdraft")

# kind name -> (module, class): imported on first use
_CLASSES = {"model": ("specdraft.drafters.model", "ModelDrafter"),
            "ngram": ("specdraft.drafters.ngram", "NgramDrafter"),
            "layers": ("specdraft.drafters.layers", "LayersDrafter"),
            "suffix": ("specdraft.drafters.suffix", "SuffixDrafter"),
            "head": ("specdraft.drafters.head", "HeadDrafter"),
            "steered": ("specdraft.drafters.steered", "SteeredDrafter")}
KINDS = tuple(PARSERS)


def kind_class(kind: str) -> type["Drafter"]:
    module, name = _CLASSES[kind]
    return getattr(importlib.import_module(module), name)


def scored_by_own_forward(kind: str) -> bool:
    """Whether full-information scoring runs a drafter of `kind`'s own forward
    (`DrafterTraits.scored_by_own_forward`): what a trace that did not record it asks. The plain
    arm's kind ("none") is not a drafter kind: it drafts nothing, so nothing is scored."""
    return kind in _CLASSES and kind_class(kind).traits.scored_by_own_forward


@dataclass(frozen=True)
class DrafterConfig:
    name: str
    kind: str
    options: Any  # the kind's own frozen options object


def parse_drafter(table: Table, base: Path) -> DrafterConfig:
    name = table.get("name", str)
    if not name:
        raise table.error("name", "every drafter needs a non-empty name")
    if name == "none":
        raise table.error("name", '"none" is reserved for plain decoding')
    kind = table.get("kind", str)
    if kind is None:
        raise table.error("kind", f"missing; expected one of {', '.join(KINDS)}")
    if kind not in PARSERS:
        raise table.error("kind", f'unknown kind "{kind}"; expected one of {", ".join(KINDS)}')
    return DrafterConfig(name, kind, PARSERS[kind](table, base))


def build_pool(configs: Sequence[DrafterConfig], pool: "PoolContext", warn_absent: bool = True
               ) -> tuple[list["Drafter"], dict[str, str]]:
    """The drafters that could be built, and {name: why} for optional ones left out (each
    logged as a warning unless `warn_absent` is off)."""
    from specdraft.drafters.base import DrafterUnavailable

    drafters, absent = [], {}
    for i, config in enumerate(configs):
        try:
            drafters.append(kind_class(config.kind).build(config.name, config.options, pool, f"drafters[{i}]", i))
        except DrafterUnavailable as exc:
            if warn_absent:
                log.warning('drafter "%s" left out of the pool: %s', config.name, exc)
            absent[config.name] = str(exc)
    return drafters, absent


def built_in_pool_toml(heads: Sequence[tuple[str, str]] = (), heads_folder: str = "") -> str:
    """The drafter tables of the pool `-m MODEL` runs (commands/model_flag.py), commented:
    drafters that need nothing trained, then a `head` drafter per trained head found for
    the model, (name, folder) in `heads`; without one, how to add one."""
    text = """# Prompt lookup: copies what follows an earlier occurrence of the last few tokens.
[[drafters]]
name = "lookup"
kind = "ngram"

# Suffix drafter: matches the prompt, this run's earlier answers and (learn = true) what
# earlier runs with this tokenizer generated, kept under the cache folder.
[[drafters]]
name = "suffix"
kind = "suffix"
learn = true
"""
    shown = heads_folder.replace("\n", " ")  # (a comment line)
    where = f" (`specdraft train head -m MODEL` writes to {shown}, where -m looks)" if heads_folder else ""
    if not heads:
        return text + f"""
# A trained draft head drafts where nothing is copied{where}:
# [[drafters]]
# name = "head"
# kind = "head"
# path = "heads/my-model"
"""
    text += f"\n# Draft heads trained for this model{where}:\n"
    for name, folder in heads:
        escaped = folder.replace("\\", "\\\\").replace('"', '\\"')
        text += f'[[drafters]]\nname = "{name}"\nkind = "head"\npath = "{escaped}"\n\n'
    return text
