"""`specdraft bench`: live (every configuration on every prompt, interleaved) or
`--replay TRACE` (policies replayed offline)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_OK, warner
from specdraft.config.profile import PolicyConfig, load_profile, policy_from_flag
from specdraft.errors import UsageError
from specdraft.learning.policies import POLICIES
from specdraft.measurement.baselines import transformers_configs
from specdraft.measurement.benchmark import PLAIN, Sample, plain_config, policy_configs, run_bench, summarize
from specdraft.measurement.datasets import load_dataset
from specdraft.measurement.replay import replay
from specdraft.measurement.traces import Trace
from specdraft.runtime import build_runtime
from specdraft.ui.progress import progress_bar
from specdraft.ui.tables import bench_table


@dataclass
class BenchOptions:
    pool: str | None
    data: str | None = None
    policies: str | None = None
    max_new_tokens: int | None = None
    limit: int | None = None
    repeat: int = 1
    baseline: str | None = None
    out: str | None = None
    csv_file: str | None = None
    plot: str | None = None
    replay: str | None = None
    chat: bool | None = None
    seed: int | None = None


def run_bench_command(opts: BenchOptions, console: Console) -> int:
    if opts.replay:
        return _replay_command(opts, console)
    if not opts.pool or not opts.data:
        raise UsageError("bench needs --pool and --data (or --replay TRACE)")
    if opts.baseline not in (None, "transformers"):
        raise UsageError(f'--baseline: unknown "{opts.baseline}"; expected transformers')
    if opts.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    profile = load_profile(opts.pool).with_overrides(max_new_tokens=opts.max_new_tokens, seed=opts.seed)
    examples = load_dataset(opts.data, warner(console), opts.limit)
    runtime = build_runtime(profile)
    flags = [f.strip() for f in opts.policies.split(",") if f.strip()] if opts.policies else None
    configs = [plain_config(profile, runtime, opts.chat)] + policy_configs(profile, flags, runtime, opts.chat)
    if opts.baseline == "transformers":
        configs += transformers_configs(profile, runtime, opts.chat)
    total = len(configs) * (1 + opts.repeat * len(examples))
    with progress_bar(console, "bench", total) as tick:
        samples = run_bench(configs, examples, opts.repeat, tick)
    rows = summarize(samples)
    console.print(bench_table(rows, f"specdraft bench · {len(examples)} prompts × {opts.repeat} repeats · "
                                    f"speedup = wall time of plain decoding / wall time"))
    mismatched = sum(s.mismatch for s in samples if s.config != "plain")
    if mismatched:
        console.print(f"[bold red]{mismatched} greedy outputs differ from plain decoding[/]")
    _write_outputs(opts, rows, [s.as_dict() for s in samples])
    if opts.plot:
        from specdraft.measurement.plot import plot_bench

        plot_bench(rows, samples, Path(opts.plot))
    return EXIT_OK


def _replay_command(opts: BenchOptions, console: Console) -> int:
    trace = Trace.load(opts.replay)
    base = load_profile(opts.pool).policy if opts.pool else PolicyConfig("random")
    flags = [f.strip() for f in (opts.policies or "").split(",") if f.strip()]
    if not flags:
        flags = [base.name] + [f"fixed:{name}" for name in trace.header.drafters]
    samples = []
    for index, flag in enumerate(dict.fromkeys(flags)):
        results = replay(trace, _policy_from_flag(flag, base, trace), seed=opts.seed or 0)
        if index == 0:  # the plain baseline every simulated speedup is a ratio to
            samples += [Sample(r.id, r.task, PLAIN, 1, r.tokens, r.tokens, r.plain_simulated_s) for r in results]
        samples += [Sample(r.id, r.task, flag, 1, r.tokens, r.rounds, r.simulated_s, r.accepted_at, r.drafted_at,
                           r.regret, r.best_drafter, r.best_arm_share) for r in results]
    rows = summarize(samples)
    for row in rows:
        row["tokens_per_s"] = None  # simulated time: only ratios are meaningful
        row["mismatches"] = None  # replay follows the recorded trajectory by construction
    console.print(bench_table(rows, f"specdraft bench --replay {opts.replay} · {len(trace.prompts)} prompts · "
                                    "simulated from measured forward costs", simulated=True))
    _write_outputs(opts, rows, [s.as_dict() for s in samples])
    return EXIT_OK


def _policy_from_flag(flag: str, base: PolicyConfig, trace: Trace) -> PolicyConfig:
    """Like `--policy`, but checked against the trace's drafters instead of a profile."""
    config = policy_from_flag(flag, base)
    if config.name not in POLICIES:
        raise UsageError(f'--policies: unknown policy "{config.name}"; expected one of {", ".join(POLICIES)}')
    drafter = config.options.get("drafter")
    if drafter is not None and drafter not in trace.header.drafters and drafter != "none":
        raise UsageError(f'--policies: no drafter "{drafter}" in the trace ({", ".join(trace.header.drafters)})')
    return config


def _write_outputs(opts: BenchOptions, rows: list[dict], samples: list[dict]) -> None:
    if opts.out:
        Path(opts.out).write_text(json.dumps({"summary": rows, "samples": samples}, indent=1), encoding="utf-8")
    if opts.csv_file:
        with open(opts.csv_file, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                writer.writerow({k: (" ".join("" if a is None else f"{a:.4f}" for a in v) if isinstance(v, list) else v)
                                 for k, v in row.items()})
