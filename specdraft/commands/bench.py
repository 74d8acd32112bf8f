"""`specdraft bench`: live (every configuration on every prompt, interleaved) or
`--replay TRACE` (policies replayed offline).

Every flag and output path is checked before any model loads. With `--out FILE` each
prompt's samples are appended to `FILE`'s sibling `<stem>.samples.jsonl` as soon as every
configuration has run it, and FILE (summary and samples) is written at the end; Ctrl-C
prints and writes the summary of what was measured so far, then exits 130.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from specdraft.commands.io import (EXIT_INTERRUPTED, EXIT_OK, CommandExit, check_count, check_seed, labelled,
                                   warner)
from specdraft.commands.outputs import JsonLines, atomic_write_text, check_outputs, stdout_console, write_flat_csv
from specdraft.errors import UsageError

if TYPE_CHECKING:
    from specdraft.profile import Profile
    from specdraft.measurement.benchmark import Config, Sample
    from specdraft.measurement.datasets import Example


@dataclass
class BenchOptions:
    pool: str | None
    data: str | None = None
    policies: str | None = None
    max_new_tokens: int | None = None
    limit: int | None = None
    repeat: int = 1
    baseline: str | None = None  # comma-separated: transformers, transformers-packed, llama.cpp
    out: str | None = None
    csv_file: str | None = None
    plot: str | None = None
    replay: str | None = None
    chat: bool | None = None
    seed: int | None = None
    temperature: float | None = None  # over the profile's; > 0 samples (outputs then differ by design)
    skip: int = 0  # prompts left out of the summary (they still run and warm learning drafters)
    versus: str | None = None  # a configuration every row's speed is also a ratio to
    engine: str = "specdraft"  # "vllm": vLLM plain, its built-in speculation and specdraft's proposer
    concurrency: str | None = None  # with --engine vllm: comma-separated requests in flight
    quick: bool = False  # a first look: QUICK_PROMPTS prompts, QUICK_TOKENS tokens, the profile's policy only
    verbose: bool = False  # the wide table: acceptance by position, regret, time split, draft lengths


QUICK_PROMPTS, QUICK_TOKENS = 4, 32


# transformers' own generation on the stock kernels, and the same over the packed target
# (measurement/baselines.py); llama.cpp on the target's GGUF file (measurement/llama_cpp.py).
BASELINES = ("transformers", "transformers-packed", "llama.cpp")


def samples_path(out: str) -> Path:
    """Where `--out FILE` streams per-prompt samples: FILE's stem + `.samples.jsonl`."""
    return Path(out).with_suffix(".samples.jsonl")


def run_bench_command(opts: BenchOptions, console: Console) -> int:
    if opts.engine == "vllm":
        from specdraft.commands.bench_vllm import run_vllm_bench_command

        return run_vllm_bench_command(opts, console)
    if opts.engine != "specdraft":
        raise UsageError(f'--engine {opts.engine}: expected "specdraft" or "vllm"')
    if opts.concurrency:
        raise UsageError("--concurrency needs --engine vllm (specdraft's own engine decodes one request at a time)")
    if opts.quick:
        opts = dataclasses.replace(opts, limit=min(opts.limit or QUICK_PROMPTS, QUICK_PROMPTS),
                                   max_new_tokens=opts.max_new_tokens or QUICK_TOKENS, repeat=1)
    _check_options(opts)
    if opts.replay:
        return _replay_command(opts, console)
    profile, flags, examples = _checked_inputs(opts, console)
    configs = _configs(opts, profile, flags, examples, console)
    _check_versus(opts.versus, [c.label for c in configs])
    samples = _measure(opts, console, configs, examples, profile.decode.greedy)
    what = f"{len(examples)} prompts × {opts.repeat} repeats"
    _report(opts, console, samples, what if profile.decode.greedy else f"{what} · sampled at T = "
            f"{profile.decode.temperature:g}", greedy=profile.decode.greedy)
    return EXIT_OK


def _checked_inputs(opts: BenchOptions, console: Console) -> tuple[Profile, list[str] | None, list[Example]]:
    """The profile with the flags over it, the `--policies` flags and the prompts: everything
    the user wrote, checked before torch, transformers or a model loads."""
    from specdraft.profile import load_profile, refuse_penalty, split_policy_flags
    from specdraft.measurement.datasets import load_dataset

    profile = load_profile(opts.pool).with_overrides(max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                                                     temperature=opts.temperature)
    if opts.baseline and not profile.decode.greedy:
        raise UsageError(f"--baseline {opts.baseline} times greedy decoding; it cannot run with temperature > 0")
    if opts.baseline:
        refuse_penalty(profile, f"--baseline {opts.baseline}")
    if "llama.cpp" in _baselines(opts.baseline):
        from specdraft.measurement.llama_cpp import llama_cpp_problem

        problem = llama_cpp_problem(profile)
        if problem is not None:
            raise UsageError(f"--baseline llama.cpp: {problem}")
    flags = split_policy_flags(opts.policies) if opts.policies else ([profile.policy.name] if opts.quick else None)
    for flag in flags or ():
        profile.with_overrides(policy=flag)  # a bad --policies entry is a usage error now
    examples = load_dataset(opts.data, warner(console), opts.limit)
    _check_skip(opts.skip, len(examples))
    return profile, flags, examples


def _check_skip(skip: int, prompts: int) -> None:
    if skip >= prompts:
        raise UsageError(f"--skip {skip} leaves none of the {prompts} prompts to summarize")


def _check_versus(versus: str | None, names: list[str]) -> None:
    """`--versus` names a configuration this bench runs (checked before anything is measured)."""
    if versus is not None and versus not in names:
        raise UsageError(f'--versus: no configuration "{versus}" in this bench ({", ".join(names)})')


def _configs(opts: BenchOptions, profile: Profile, flags: list[str] | None, examples: list[Example],
             console: Console) -> list[Config]:
    """The models loaded once, and every configuration bench runs over them: plain decoding
    first, then the policies, then the baselines."""
    from specdraft.measurement.baselines import transformers_configs
    from specdraft.measurement.benchmark import plain_config, policy_configs
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_ids import check_prompts
    from specdraft.ui.progress import loading

    # transformers' own generation runs on the stock kernels (what its users get), so a packed
    # target keeps its dense weights too when it is a baseline.
    baselines = _baselines(opts.baseline)
    with loading(console):
        runtime = build_runtime(profile, keep_dense="transformers" in baselines, record=False)
    learning = [d.name for d in profile.drafters if getattr(d.options, "learn", False)]
    if learning:
        console.print(f"note: {', '.join(learning)} draft(s) from the learned store as it was at the start and "
                      "record nothing: every pass sees the same store, and bench leaves it as it found it",
                      markup=False)
    check_prompts(runtime, ((e.id, e.prompt) for e in examples), opts.chat, f"--data {opts.data}")
    configs = [plain_config(profile, runtime, opts.chat)] + policy_configs(profile, flags, runtime, opts.chat)
    for baseline in baselines:
        if baseline == "llama.cpp":
            from specdraft.measurement.llama_cpp import llama_cpp_configs

            configs += llama_cpp_configs(profile, runtime, opts.chat)
        else:
            configs += transformers_configs(profile, runtime, opts.chat, packed=baseline == "transformers-packed")
    return configs


def _measure(opts: BenchOptions, console: Console, configs: list[Config], examples: list[Example],
             greedy: bool) -> list[Sample]:
    """Run every configuration on every prompt, streaming each prompt's samples to the
    samples file; on Ctrl-C, report what was measured and exit 130."""
    from specdraft.measurement.benchmark import run_bench
    from specdraft.ui.progress import progress_bar

    total = len(configs) * (1 + opts.repeat * len(examples))
    samples: list[Sample] = []
    stream = JsonLines(samples_path(opts.out)) if opts.out else None
    with progress_bar(console, "bench", total) as progress:
        progress.note(f"warming up {len(configs)} configurations")

        def keep(done: list[Sample]) -> None:
            samples.extend(done)
            if stream is not None:
                for sample in done:
                    stream.write(sample.as_dict())
            if opts.out or opts.csv_file:  # what was measured so far, whole: a killed bench keeps it
                from specdraft.measurement.summary import summarize

                _write_outputs(opts, summarize(samples), [s.as_dict() for s in samples], None)
            times = ", ".join(f"{s.config} {s.elapsed_s:.2f}s" for s in done)
            progress.note(f"prompt {len(samples) // len(configs)}/{opts.repeat * len(examples)} "
                          f"({done[0].id}, repeat {done[0].repeat}): {times}")

        try:
            run_bench(configs, examples, opts.repeat, progress.tick, keep, greedy=greedy)
        except KeyboardInterrupt:
            if samples:
                _report(opts, console, samples, f"interrupted after {len(samples) // len(configs)} prompt runs",
                        greedy=greedy)
            console.print("interrupted" + (f"; samples kept in {samples_path(opts.out)}" if stream else ""),
                          markup=False)
            raise CommandExit(EXIT_INTERRUPTED) from None
        finally:
            if stream is not None:
                stream.close()
    return samples


def _baselines(flag: str | None) -> list[str]:
    """`--baseline` as a list of distinct names, in the order given (torch-free)."""
    if not flag:
        return []
    names = [name.strip() for name in flag.split(",")]
    for name in names:
        if name not in BASELINES:
            raise UsageError(f'--baseline: unknown "{name}"; expected {", ".join(BASELINES)} (several comma-separated)')
    if len(set(names)) < len(names):
        raise UsageError(f"--baseline names a baseline twice: {flag}")
    return names


def _check_options(opts: BenchOptions) -> None:
    """Everything that can be wrong with the command line, before anything is loaded."""
    if not opts.replay and (not opts.pool or not opts.data):
        raise UsageError("bench needs --pool and --data (or --replay TRACE)")
    _baselines(opts.baseline)
    if opts.baseline and opts.replay:
        raise UsageError("--baseline runs models; it cannot be combined with --replay")
    check_count(opts.repeat, "--repeat")
    check_count(opts.limit, "--limit")
    if opts.skip < 0:
        raise UsageError(f"--skip: must be 0 or more (got {opts.skip})")
    check_seed(opts.seed)
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'specdraft[plot]'")
    outputs = [("--out", opts.out), ("--csv", opts.csv_file), ("--plot", opts.plot)]
    if opts.out and not opts.replay:
        outputs.append(("--out (its samples file)", str(samples_path(opts.out))))
    check_outputs(outputs, inputs=[("--data", opts.data), ("--pool", opts.pool), ("--replay", opts.replay)])


def _report(opts: BenchOptions, console: Console, samples: list, what: str, simulated: bool = False,
            greedy: bool = True, bounds: list[dict] | None = None) -> list[dict]:
    """The table, the warnings, and every output file for `samples` (and a replay's
    hindsight `bounds`)."""
    from specdraft.measurement.benchmark import PLAIN
    from specdraft.measurement.summary import add_versus, after_warmup, noise_warnings, summarize
    from specdraft.models.kernels.native import kernels_in_use
    from specdraft.ui.tables import bench_table, hindsight_table

    rows = summarize(after_warmup(samples, opts.skip))
    if opts.versus:
        add_versus(rows, opts.versus)
    if opts.skip:
        what += f" · summary leaves out the first {opts.skip}"
    if not greedy:
        for row in rows:
            row["mismatches"] = None  # sampled outputs differ by design; tests/test_sampling checks the law
    if simulated:
        for row in rows:
            row["tokens_per_s"] = None  # simulated time: only ratios are meaningful
            row["mismatches"] = None  # replay follows the recorded trajectory by construction
        title = f"specdraft bench --replay {opts.replay} · {what} · simulated from measured forward costs"
    else:
        title = f"specdraft bench · {what} · speedup = wall time of plain decoding / wall time"
    title += f" · kernels {isa}" if (isa := kernels_in_use()) else ""  # which of specdraft's CPU kernels ran
    table_out = stdout_console(opts.verbose)  # the results are the output; progress and warnings stay on stderr
    table_out.print(bench_table(rows, title, simulated=simulated, versus=opts.versus, wide=opts.verbose))
    if bounds:
        table_out.print(hindsight_table(bounds))
    for line in noise_warnings(rows):
        console.print(labelled("warning:", "yellow", line), soft_wrap=True)
    mismatched = sum(s.mismatch for s in samples if s.config != PLAIN)
    if mismatched:
        console.print(f"[bold red]{mismatched} greedy outputs differ from plain decoding[/]")
    _write_outputs(opts, rows, [s.as_dict() for s in samples], bounds)
    if opts.plot:
        from specdraft.measurement.plot import plot_bench

        plot_bench(rows, samples, Path(opts.plot))
    return rows


def _replay_command(opts: BenchOptions, console: Console) -> int:
    from specdraft.profile import PolicyConfig, load_profile
    from specdraft.measurement.benchmark import PLAIN, Sample
    from specdraft.measurement.replay import hindsight, replay
    from specdraft.measurement.traces import Trace

    trace = Trace.load(opts.replay, flag="--replay")
    profile = load_profile(opts.pool) if opts.pool else None
    if profile is not None:
        _check_same_pool(opts.pool, [d.name for d in profile.drafters], trace.header.drafters)
    base = profile.policy if profile is not None else PolicyConfig("random")
    flags = [f.strip() for f in (opts.policies or "").split(",") if f.strip()]
    if not flags:
        flags = [base.name] + [f"fixed:{name}" for name in trace.header.drafters]
    configs = [_policy_from_flag(flag, base, trace) for flag in dict.fromkeys(flags)]  # all checked before any runs
    _check_skip(opts.skip, len(trace.prompts))
    _check_versus(opts.versus, [PLAIN, *dict.fromkeys(flags)])
    samples = []
    for index, (flag, config) in enumerate(zip(dict.fromkeys(flags), configs)):
        results = replay(trace, config, seed=opts.seed or 0)
        if index == 0:  # the plain baseline every simulated speedup is a ratio to
            samples += [Sample(r.id, r.task, PLAIN, 1, r.tokens, r.tokens, r.plain_simulated_s) for r in results]
        samples += [Sample(r.id, r.task, flag, 1, r.tokens, r.rounds, r.simulated_s, r.accepted_at, r.drafted_at,
                           r.regret, r.best_drafter, r.best_arm_share, regret_unit=r.regret_unit,
                           tree_rounds=r.tree_rounds, branches=r.branches, branched=r.branched, won=r.won)
                    for r in results]
    _report(opts, console, samples, f"{len(trace.prompts)} prompts", simulated=True,
            bounds=[bound.as_dict() for bound in hindsight(trace)])
    return EXIT_OK


def _check_same_pool(pool: str, names: list[str], traced: list[str]) -> None:
    """A replay replays the pool the trace recorded; --pool only lends its policy. A trace
    with a drafter the profile lacks is another pool (refused); a profile drafter missing
    from the trace was left out when it was recorded (an optional one), which is said."""
    mine, theirs = [n for n in names if n != "none"], [n for n in traced if n != "none"]
    foreign = [n for n in theirs if n not in mine]
    if foreign:
        raise UsageError(f"--pool {pool}: the trace's drafters ({', '.join(theirs)}) are not this profile's "
                         f"({', '.join(mine) or 'none'}); a replay can only replay the pool that was traced")
    missing = [n for n in mine if n not in theirs]
    if missing:
        logging.getLogger("specdraft").warning("specdraft: the trace has no lanes for %s of %s; the replay leaves "
                                               "them out", ", ".join(missing), pool)


def _policy_from_flag(flag: str, base, trace):
    """Like `--policy`, but checked against the trace's drafters instead of a profile."""
    from specdraft.profile import policy_from_flag
    from specdraft.learning.policies import POLICIES, check_policy

    config = policy_from_flag(flag, base)
    if config.name not in POLICIES:
        raise UsageError(f'--policies: unknown policy "{config.name}"; expected one of {", ".join(POLICIES)}')
    drafter = config.options.get("drafter")
    if drafter is not None and drafter not in trace.header.drafters and drafter != "none":
        raise UsageError(f'--policies: no drafter "{drafter}" in the trace ({", ".join(trace.header.drafters)})')
    problems = check_policy(config.name, config.options, list(trace.header.drafters))
    if problems:
        option, message = problems[0]
        raise UsageError(f"--policies ({config.name}.{option}): {message}")
    return config


def _write_outputs(opts: BenchOptions, rows: list[dict], samples: list[dict], bounds: list[dict] | None) -> None:
    if opts.out:
        from specdraft.models.kernels.native import kernels_in_use  # which CPU kernels ran (None: none did)
        written = {"summary": rows, "samples": samples, "kernels": kernels_in_use()}
        atomic_write_text(opts.out, json.dumps(written | ({"hindsight": bounds} if bounds else {}), indent=1))
    if opts.csv_file and rows:
        write_flat_csv(opts.csv_file, rows)
