"""`calibrate-beta`: sweep a policy parameter over replays of a trace, and write the best
value back into the profile without disturbing its comments or layout."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from specdraft.errors import UsageError
from specdraft.policies import POLICIES
from specdraft.profile import PolicyConfig
from specdraft.replay import replay
from specdraft.trace import Trace

# Parameters a sweep can explain: policy -> parameter -> default grid.
TUNABLE = {
    "ucb": {"beta": [0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]},
    "ducb": {"beta": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3], "discount": [0.8, 0.9, 0.95, 0.98, 0.99, 1.0]},
    "swucb": {"beta": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3], "window": [10, 20, 50, 100, 200]},
    "exp3": {"gamma": [0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0]},
    "halving": {"c": [1.0, 2.0, 4.0, 8.0, 16.0]},
    "hedge": {"eta": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]},
}
PAPER_DEFAULTS = {("ucb", "beta"): 0.01, ("ducb", "beta"): 0.01, ("swucb", "beta"): 0.01, ("exp3", "gamma"): 0.4}


@dataclass
class SweepRow:
    value: float
    mean_accepted: float
    simulated_speedup: float
    regret: float | None


def check_tunable(policy: str, param: str) -> None:
    if policy not in TUNABLE or param not in TUNABLE[policy]:
        known = "; ".join(f"{p}: {', '.join(ps)}" for p, ps in TUNABLE.items())
        raise UsageError(f"cannot calibrate {policy}.{param}: tunable parameters are {known}")


def sweep(trace: Trace, base: PolicyConfig, param: str, grid: list[float], seed: int = 0) -> list[SweepRow]:
    rows = []
    cast = int if isinstance(POLICIES[base.name].all_options()[param].default, int) else float
    for value in grid:
        config = replace(base, options=dict(base.options) | {param: cast(value)})
        results = replay(trace, config, seed=seed)
        tokens = sum(r.tokens for r in results)
        rounds = sum(r.rounds for r in results)
        plain = sum(r.plain_simulated_s for r in results)
        spent = sum(r.simulated_s for r in results)
        regrets = [r.regret for r in results if r.regret is not None]
        rows.append(SweepRow(cast(value), tokens / rounds if rounds else 0.0, plain / spent if spent else 0.0,
                             sum(regrets) / len(regrets) if regrets else None))
    return rows


def best_row(rows: list[SweepRow], prefer: float | None = None) -> SweepRow:
    """Fastest by simulated speedup; mean accepted tokens breaks ties, then the `prefer`red
    (published) value, so a flat sweep does not move a setting for nothing."""
    return max(rows, key=lambda r: (round(r.simulated_speedup, 6), round(r.mean_accepted, 6), r.value == prefer))


_SECTION = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def write_policy_option(file: Path, key: str, value: float) -> None:
    """Set `[policy] key = value` in place: the line is rewritten if present (its comment
    kept), else added at the end of the table; nothing else in the file changes."""
    lines = Path(file).read_text(encoding="utf-8").splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if (m := _SECTION.match(line)) and m.group(1).strip() == "policy"),
                 None)
    if start is None:
        raise UsageError(f"{file}: has no [policy] table to write {key} into")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    literal = repr(value) if isinstance(value, float) else str(value)
    pattern = re.compile(rf"^(\s*{re.escape(key)}\s*=\s*)([^#\r\n]*?)(\s*#[^\r\n]*)?(\r?\n)?$")
    for i in range(start + 1, end):
        match = pattern.match(lines[i])
        if match:
            lines[i] = f"{match.group(1)}{literal}{match.group(3) or ''}{match.group(4) or ''}"
            break
    else:
        insert = end
        while insert > start + 1 and not lines[insert - 1].strip():
            insert -= 1  # keep blank lines that separate tables after the new key
        if insert > 0 and not lines[insert - 1].endswith("\n"):
            lines[insert - 1] += "\n"
        lines.insert(insert, f"{key} = {literal}\n")
    Path(file).write_text("".join(lines), encoding="utf-8")
