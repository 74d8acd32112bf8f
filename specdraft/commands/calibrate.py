"""`specdraft calibrate-beta`: the best exploration strength (or another parameter) for a
workload, from replays of one trace, optionally written back into the profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_OK, warner
from specdraft.commands.trace import trace_with_progress
from specdraft.config.edit import write_policy_option
from specdraft.config.profile import PolicyConfig, load_profile
from specdraft.errors import UsageError
from specdraft.measurement.datasets import load_dataset
from specdraft.measurement.sweeps import PAPER_DEFAULTS, TUNABLE, best_row, check_tunable, sweep
from specdraft.measurement.traces import Trace
from specdraft.ui.tables import sweep_table


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
    profile = load_profile(opts.pool)
    name = opts.policy or (profile.policy.name if profile.policy.name in TUNABLE else "ucb")
    check_tunable(name, opts.param)
    if opts.reward not in (None, "bd", "be"):
        raise UsageError(f'--reward: unknown "{opts.reward}"; expected bd or be')
    options = dict(profile.policy.options) if profile.policy.name == name else {}
    options.pop(opts.param, None)
    if opts.reward:
        options["reward"] = opts.reward
    base = PolicyConfig(name, options)
    grid = _grid(opts.grid) if opts.grid else TUNABLE[name][opts.param]

    trace = _trace(opts, profile, console)
    rows = sweep(trace, base, opts.param, grid)
    paper = PAPER_DEFAULTS.get((name, opts.param))
    best = best_row(rows, prefer=paper)
    console.print(sweep_table(name, opts.param, rows, best, paper))
    line = f"best {opts.param} = {best.value:g}: simulated speedup {best.simulated_speedup:.3f}x, mean accepted {best.mean_accepted:.3f}"
    reference = next((r for r in rows if paper is not None and r.value == paper), None)
    if reference is not None:
        line += (f"; vs the paper's {paper:g}: {best.simulated_speedup / reference.simulated_speedup - 1:+.1%} speed, "
                 f"{best.mean_accepted / reference.mean_accepted - 1:+.1%} mean accepted")
    console.print(line, soft_wrap=True)
    if opts.write:
        if profile.policy.name != name:
            raise UsageError(f'--write: the profile\'s policy is "{profile.policy.name}", not "{name}"; '
                             f"set [policy] name = \"{name}\" first")
        write_policy_option(Path(opts.pool), opts.param, best.value)
        load_profile(opts.pool)  # the edited file must still be a valid profile
        console.print(f"wrote [policy] {opts.param} = {best.value:g} to {opts.pool}", markup=False)
    return EXIT_OK


def _trace(opts: CalibrateOptions, profile, console: Console) -> Trace:
    if opts.trace_file and Path(opts.trace_file).exists():
        return Trace.load(opts.trace_file)
    if not opts.data:
        raise UsageError("calibrate-beta needs --data to record a trace (or --trace with an existing trace file)")
    profile = profile.with_overrides(max_new_tokens=opts.max_new_tokens)
    examples = load_dataset(opts.data, warner(console), opts.limit)
    trace = trace_with_progress(profile, examples, opts.chat, console)
    if opts.trace_file:
        trace.save(opts.trace_file)
    return trace


def _grid(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--grid: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UsageError("--grid is empty")
    return values
