"""Per-generation statistics from round records; plain Python, shared by the CLI, the
panel and the benchmarks, so every number means the same thing everywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class DrafterUsage:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class GenerationStats:
    """Running totals; `add` one round at a time so a live view can read them mid-stream."""

    drafter_names: list[str]
    tokens: int = 0
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    elapsed_s: float = 0.0
    last_drafter: str | None = None
    last_accepted: int = 0
    last_drafted: int = 0
    usage: dict[str, DrafterUsage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.usage = {name: DrafterUsage() for name in self.drafter_names}

    def add(self, record) -> None:
        self.tokens += len(record.tokens)
        self.rounds += 1
        self.draft_s += record.draft_s
        self.verify_s += record.verify_s
        self.overhead_s += record.overhead_s
        self.last_drafter, self.last_accepted, self.last_drafted = record.drafter, record.accepted, record.drafted
        use = self.usage.setdefault(record.drafter, DrafterUsage())
        use.rounds += 1
        use.drafted += record.drafted
        use.accepted += record.accepted

    @property
    def mean_accepted(self) -> float:
        """Committed tokens per target verify forward, bonus token included (plain decoding: 1)."""
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "elapsed_s": round(self.elapsed_s, 4),
            "drafters": {n: {"rounds": u.rounds, "accepted": u.accepted, "drafted": u.drafted} for n, u in self.usage.items()},
            "time_s": {"draft": round(self.draft_s, 4), "verify": round(self.verify_s, 4), "overhead": round(self.overhead_s, 4)},
        }


def summarize(records: Iterable, drafter_names: list[str], elapsed_s: float) -> GenerationStats:
    stats = GenerationStats(list(drafter_names))
    for record in records:
        stats.add(record)
    stats.elapsed_s = elapsed_s
    return stats
