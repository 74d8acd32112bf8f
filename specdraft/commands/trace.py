"""`specdraft trace`: decode each prompt once and score every drafter on it, for replay."""

from __future__ import annotations

from rich.console import Console

from specdraft.commands.io import EXIT_OK, warner
from specdraft.config.profile import Profile, load_profile
from specdraft.measurement.datasets import Example, load_dataset
from specdraft.measurement.traces import Trace, record_trace
from specdraft.runtime import build_runtime
from specdraft.ui.progress import progress_bar


def run_trace_command(pool: str, data: str, out: str, max_new_tokens: int | None, limit: int | None,
                      chat: bool | None, console: Console) -> int:
    profile = load_profile(pool).with_overrides(max_new_tokens=max_new_tokens)
    examples = load_dataset(data, warner(console), limit)
    trace = trace_with_progress(profile, examples, chat, console)
    trace.save(out)
    console.print(f"traced {len(trace.prompts)} prompts, {sum(len(p.tokens) for p in trace.prompts)} tokens → {out}",
                  markup=False)
    return EXIT_OK


def trace_with_progress(profile: Profile, examples: list[Example], chat: bool | None, console: Console) -> Trace:
    runtime = build_runtime(profile)
    with progress_bar(console, "trace", len(examples)) as tick:
        return record_trace(runtime, examples, chat, lambda example: tick(example.id))
