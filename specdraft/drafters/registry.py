"""The drafter kinds a profile may name, and the pool factory: `[[drafters]]` tables in,
ready drafters out. The only place that maps kind names to classes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specdraft.config.tables import Table
from specdraft.drafters.base import Drafter, PoolContext
from specdraft.drafters.layers import LayersDrafter
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter

KINDS: dict[str, type[Drafter]] = {cls.kind: cls for cls in (ModelDrafter, NgramDrafter, LayersDrafter)}


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
    if kind not in KINDS:
        raise table.error("kind", f'unknown kind "{kind}"; expected one of {", ".join(KINDS)}')
    return DrafterConfig(name, kind, KINDS[kind].parse_options(table, base))


def build_pool(configs: Sequence[DrafterConfig], pool: PoolContext) -> list[Drafter]:
    return [KINDS[c.kind].build(c.name, c.options, pool, f"drafters[{i}]") for i, c in enumerate(configs)]
