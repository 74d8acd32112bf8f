"""`specdraft trace`: decode each prompt once and score every drafter on it, for replay.

The output path is checked before any model loads, every prompt is checked against the
context length before the first is decoded, and the trace is written as it is recorded
(header line, then one line per prompt, flushed), so Ctrl-C or a crash keeps every prompt
traced so far.
"""

from __future__ import annotations

from rich.console import Console

from specdraft.commands.io import EXIT_INTERRUPTED, EXIT_OK, CommandExit, check_count, warner
from specdraft.commands.outputs import check_outputs
from specdraft.errors import UsageError


def run_trace_command(pool: str, data: str, out: str, max_new_tokens: int | None, limit: int | None,
                      chat: bool | None, console: Console) -> int:
    check_count(limit, "--limit")
    check_outputs([("--out", out)], inputs=[("--data", data), ("--pool", pool)])
    from specdraft.profile import load_profile
    from specdraft.measurement.datasets import load_dataset

    profile = load_profile(pool).with_overrides(max_new_tokens=max_new_tokens)
    examples = load_dataset(data, warner(console), limit)
    trace = trace_with_progress(profile, examples, chat, console, out, data)
    console.print(f"traced {len(trace.prompts)} prompts, {sum(len(p.tokens) for p in trace.prompts)} tokens → {out}",
                  markup=False)
    return EXIT_OK


def trace_with_progress(profile, examples, chat: bool | None, console: Console, out: str | None, data: str):
    """Record a trace of `examples`, streamed to `out` when given; on Ctrl-C say what was kept."""
    if not profile.decode.greedy:
        raise UsageError("traces need greedy decoding (temperature = 0): only then is the trajectory drafter-free")
    from specdraft.measurement.traces import TraceWriter, record_trace
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_ids import check_prompts
    from specdraft.ui.progress import loading, progress_bar

    with loading(console):
        runtime = build_runtime(profile, record=False)
    check_prompts(runtime, ((e.id, e.prompt) for e in examples), chat, f"--data {data}")
    writer = TraceWriter(out) if out else None
    traced = 0
    with progress_bar(console, "trace", len(examples)) as progress:
        def done(example) -> None:
            nonlocal traced
            traced += 1
            progress.tick(example.id)
            progress.note(f"prompt {traced}/{len(examples)} ({example.id}) traced")

        try:
            return record_trace(runtime, examples, chat, done, sink=writer)
        except KeyboardInterrupt:
            kept = f" and kept in {out}" if out else ""
            console.print(f"interrupted: {traced} of {len(examples)} prompts traced{kept}", markup=False)
            raise CommandExit(EXIT_INTERRUPTED) from None
        finally:
            if writer is not None:
                writer.close()
