"""`specdraft bench --engine vllm`: the command's checks, its table and its output files
(the runs themselves: measurement/vllm_bench.py). Every flag is checked before vLLM starts;
flags that only the specdraft engine has are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_count, warner
from specdraft.commands.outputs import atomic_write_text, check_outputs
from specdraft.errors import UsageError

MAX_CONCURRENCY = 1024


def parse_concurrency(flag: str | None) -> list[int]:
    if not flag:
        return [1]
    values = []
    for part in flag.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise UsageError(f"--concurrency {flag}: expected whole numbers, comma-separated (e.g. 1,8,32)") from None
        if not 1 <= value <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency {flag}: each value must be 1..{MAX_CONCURRENCY}")
        values.append(value)
    if len(set(values)) < len(values):
        raise UsageError(f"--concurrency names a value twice: {flag}")
    return values


def run_vllm_bench_command(opts, console: Console) -> int:
    from specdraft.measurement.datasets import load_dataset
    from specdraft.profile import load_profile, refuse_penalty
    from specdraft.serving import launch
    from specdraft.serving.pool import served_drafters

    if not opts.pool or not opts.data:
        raise UsageError("bench --engine vllm needs --pool and --data")
    for flag, given in (("--replay", opts.replay), ("--baseline", opts.baseline), ("--policies", opts.policies),
                        ("--plot", opts.plot), ("--versus", opts.versus), ("--csv", opts.csv_file)):
        if given:
            raise UsageError(f"{flag} is not available with --engine vllm")
    if opts.skip:
        raise UsageError("--skip is not available with --engine vllm (every run is a fresh engine, warmed up first)")
    concurrencies = parse_concurrency(opts.concurrency)
    check_count(opts.limit, "--limit")
    check_count(opts.repeat, "--repeat")
    check_outputs([("--out", opts.out)], inputs=[("--data", opts.data), ("--pool", opts.pool)])
    profile = load_profile(opts.pool).with_overrides(max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                                                     temperature=opts.temperature)
    if not profile.decode.greedy:
        raise UsageError("bench --engine vllm compares greedy outputs; it cannot run with temperature > 0")
    refuse_penalty(profile, "bench --engine vllm")
    _, left_out = served_drafters(profile)
    warn = warner(console)
    for name, why in left_out.items():
        warn(f'drafter "{name}" left out under vLLM ({why})')
    examples = load_dataset(opts.data, warn, opts.limit)
    launch.require_vllm()
    from specdraft.measurement.vllm_bench import run_vllm_bench, table_rows
    from specdraft.ui.tables import vllm_table

    log = Path(opts.out).with_suffix(".vllm.log") if opts.out else Path.cwd() / "specdraft-vllm-bench.log"
    console.print(f"vLLM's own output goes to {log}", markup=False)
    rows = run_vllm_bench(profile, Path(opts.pool), examples, concurrencies, opts.chat, log,
                          lambda line: console.print(line, markup=False), repeats=opts.repeat)
    runs = f" · {opts.repeat} runs each, interleaved" if opts.repeat > 1 else ""
    title = (f"specdraft bench --engine vllm · {len(examples)} prompts × {profile.decode.max_new_tokens} new tokens "
             f"· greedy{runs} · output tokens/s over the run{'s' if runs else ''}")
    console.print(vllm_table(table_rows(rows), title))
    differing = sum(r.get("differing") or 0 for r in rows)
    if differing:
        console.print(f"[bold red]{differing} greedy outputs differ from vLLM plain's[/]")
    if opts.out:
        atomic_write_text(Path(opts.out), json.dumps({"summary": table_rows(rows), "runs": rows}, indent=1))
    return EXIT_OK
