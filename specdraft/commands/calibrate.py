"""`specdraft calibrate-beta`: the best exploration strength (or another parameter) for a
workload, from replays of one trace, optionally written back into the profile.

Every grid value is checked by the policy's own option check before any trace is
recorded or replayed, and the edited profile is validated in memory before it replaces
the file (config/edit.py writes it atomically), so a bad value never reaches the file.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_count, warner
from specdraft.commands.outputs import check_outputs
from specdraft.errors import ProfileError, UsageError

if TYPE_CHECKING:
    from specdraft.profile import PolicyConfig, Profile
    from specdraft.measurement.sweeps import SweepRow


@dataclass
class CalibrateOptions:
    pool: str
    data: str | None = None
    trace_file: str | None = None
    grid: str | None = None
    reward: str | None = None
    param: str = "beta"
    policy: str | None = None
    write: bool = False
    limit: int | None = None
    max_new_tokens: int | None = None
    chat: bool | None = None


def run_calibrate(opts: CalibrateOptions, console: Console) -> int:
    check_count(opts.limit, "--limit")
    if opts.reward not in (None, "bd", "be"):
        raise UsageError(f'--reward: unknown "{opts.reward}"; expected bd or be')
    grid_values = _grid(opts.grid) if opts.grid else None
    record = not (opts.trace_file and Path(opts.trace_file).exists())
    check_outputs([("--trace", opts.trace_file if record else None)], inputs=[("--data", opts.data), ("--pool", opts.pool)])
    from specdraft.profile import load_profile
    from specdraft.measurement.sweeps import PAPER_DEFAULTS, best_row, sweep
    from specdraft.ui.tables import sweep_table

    profile = load_profile(opts.pool)
    base, grid = _policy_and_grid(opts, profile, record, grid_values)
    trace = _trace(opts, profile, console, record)
    rows = sweep(trace, base, opts.param, grid)
    paper = PAPER_DEFAULTS.get((base.name, opts.param))
    best = best_row(rows, prefer=paper)
    console.print(sweep_table(base.name, opts.param, rows, best, paper))
    console.print(_best_line(opts.param, rows, best, paper), soft_wrap=True, markup=False)
    if opts.write:
        from specdraft.config.edit import write_policy_option

        note = f"calibrated by specdraft calibrate-beta on {datetime.date.today().isoformat()}"
        write_policy_option(Path(opts.pool), opts.param, best.value, note=note, validate=_validator(profile.file))
        console.print(f"wrote [policy] {opts.param} = {best.value:g} to {opts.pool}", markup=False)
    return EXIT_OK


def _policy_and_grid(opts: CalibrateOptions, profile: Profile, record: bool,
                     grid_values: list[float] | None) -> tuple[PolicyConfig, list[float]]:
    """The policy swept (the profile's options but the swept one) and the values it takes,
    each checked by the policy's own option check before any work: a bad value fails here."""
    from specdraft.profile import PolicyConfig
    from specdraft.learning.policies import POLICIES, check_policy
    from specdraft.measurement.sweeps import TUNABLE, check_tunable

    name = opts.policy or (profile.policy.name if profile.policy.name in TUNABLE else "ucb")
    check_tunable(name, opts.param)
    if record and not opts.data:
        raise UsageError("calibrate-beta needs --data to record a trace (or --trace with an existing trace file)")
    if opts.write and profile.policy.name != name:
        raise UsageError(f'--write: the profile\'s policy is "{profile.policy.name}", not "{name}"; '
                         f"set [policy] name = \"{name}\" first")
    options = dict(profile.policy.options) if profile.policy.name == name else {}
    options.pop(opts.param, None)
    if opts.reward:
        options["reward"] = opts.reward
    integer = isinstance(POLICIES[name].all_options()[opts.param].default, int)
    grid = grid_values if grid_values is not None else TUNABLE[name][opts.param]
    drafters = [d.name for d in profile.drafters]
    for value in grid:
        if integer and value != int(value):
            raise UsageError(f"--grid: {name}.{opts.param} takes whole numbers (got {value:g})")
        problems = check_policy(name, options | {opts.param: int(value) if integer else value}, drafters)
        if problems:
            raise UsageError(f"--grid: {name}.{problems[0][0]} = {value:g}: {problems[0][1]}")
    return PolicyConfig(name, options), grid


def _best_line(param: str, rows: list[SweepRow], best: SweepRow, paper: float | None) -> str:
    """The best value, and how it compares with the paper's default when the grid holds it."""
    line = (f"best {param} = {best.value:g}: simulated speedup {best.simulated_speedup:.3f}x, mean accepted "
            f"{best.tokens_per_round:.3f}")
    reference = next((r for r in rows if paper is not None and r.value == paper), None)
    if reference is not None and reference.simulated_speedup and reference.tokens_per_round:
        line += (f"; vs the paper's {paper:g}: {best.simulated_speedup / reference.simulated_speedup - 1:+.1%} speed, "
                 f"{best.tokens_per_round / reference.tokens_per_round - 1:+.1%} mean accepted")
    return line


def _validator(file: Path):
    """Check the edited profile text exactly as a later run will load it."""
    from specdraft.profile import parse_profile

    def validate(text: str) -> None:
        try:
            parse_profile(text, file)
        except ProfileError as exc:
            raise UsageError(f"--write: not written, the result would be invalid: {exc}") from None

    return validate


def _trace(opts: CalibrateOptions, profile, console: Console, record: bool):
    from specdraft.commands.trace import trace_with_progress
    from specdraft.measurement.datasets import load_dataset
    from specdraft.measurement.traces import Trace

    if not record:
        return Trace.load(opts.trace_file)
    profile = profile.with_overrides(max_new_tokens=opts.max_new_tokens)
    examples = load_dataset(opts.data, warner(console), opts.limit)
    return trace_with_progress(profile, examples, opts.chat, console, opts.trace_file, opts.data)


def _grid(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--grid: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UsageError("--grid is empty")
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise UsageError(f"--grid: {bad} is not a finite number")
    return list(dict.fromkeys(values))
