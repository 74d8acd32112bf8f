"""`calibrate-beta`'s engine: sweep a policy parameter over replays of a trace and pick
the best value (writing it into the profile is config/edit.py's job)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdraft.errors import UsageError
from specdraft.learning.policies import POLICIES
from specdraft.profile import PolicyConfig
from specdraft.measurement.replay import replay
from specdraft.measurement.traces import Trace

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
    tokens_per_round: float  # committed tokens per round, the bonus token included (mean accepted tokens)
    simulated_speedup: float
    regret: float | None
    regret_unit: str | None = None  # "tokens" or "tok/s": the policy's objective


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
        unit = next((r.regret_unit for r in results if r.regret is not None), None)
        rows.append(SweepRow(cast(value), tokens / rounds if rounds else 0.0, plain / spent if spent else 0.0,
                             sum(regrets) / len(regrets) if regrets else None, unit))
    return rows


def best_row(rows: list[SweepRow], prefer: float | None = None) -> SweepRow:
    """Fastest by simulated speedup; mean accepted tokens breaks ties, then the `prefer`red
    (published) value, so a flat sweep does not move a setting for nothing."""
    return max(rows, key=lambda r: (round(r.simulated_speedup, 6), round(r.tokens_per_round, 6), r.value == prefer))
