"""`specdraft generate`: prompts in, text (or JSON lines) out on stdout, panel on stderr."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from rich.console import Console

from specdraft.commands.io import EXIT_INTERRUPTED, EXIT_OK, CommandExit
from specdraft.errors import UsageError
from specdraft.config.profile import load_profile
from specdraft.runtime import build_runtime
from specdraft.session.prompt_run import PromptRun
from specdraft.ui.panel import LiveView, stats_panel, summary_line


@dataclass
class GenerateOptions:
    pool: str
    prompt: str | None = None
    each_line: bool = False
    json_output: bool = False
    chat: bool | None = None
    panel: bool | None = None
    stats: bool = False
    policy: str | None = None
    draft_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    policy_state: str | None = None  # JSON file: load the learned policy state, save it back


def read_prompts(prompt: str | None, each_line: bool, stdin: IO[str]) -> Iterator[str]:
    """The argument, else all of piped stdin as one prompt, else one prompt per stdin line."""
    if each_line:
        if prompt is not None:
            raise UsageError("--each-line reads prompts from stdin; do not also pass PROMPT")
        if stdin.isatty():
            raise UsageError("--each-line needs prompts piped on stdin")
        return (line.rstrip("\r\n") for line in stdin if line.strip())
    if prompt is None:
        if stdin.isatty():
            raise UsageError("no prompt: pass PROMPT or pipe text on stdin")
        prompt = stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return iter([prompt])


def run_generate(opts: GenerateOptions, console: Console, stdout: IO[str] | None = None,
                 stdin: IO[str] | None = None) -> int:
    stdout, stdin = stdout or sys.stdout, stdin or sys.stdin  # looked up now: tests swap them
    profile = load_profile(opts.pool).with_overrides(
        policy=opts.policy, draft_tokens=opts.draft_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
    )
    prompts = read_prompts(opts.prompt, opts.each_line, stdin)
    out_tty = stdout.isatty()
    show_panel = opts.panel if opts.panel is not None else (console.is_terminal and out_tty and not opts.json_output)
    with console.status("loading models…") if console.is_terminal else contextlib.nullcontext():
        runtime = build_runtime(profile)
    state_file = Path(opts.policy_state) if opts.policy_state else None
    if state_file is not None and state_file.exists():
        load_policy_state(runtime.engine.policy, state_file)
    for prompt in prompts:
        run = PromptRun(runtime, prompt, opts.chat)
        # Text streams straight to stdout unless the panel shares its terminal: then the
        # panel shows it live and it is printed whole once the panel is gone.
        stream = not opts.json_output and not (show_panel and out_tty)
        try:
            if show_panel:
                with LiveView(console, profile.policy.name, show_text=out_tty and not opts.json_output) as view:
                    for delta, _ in run:
                        _emit(stdout, delta, stream)
                        view.update(run.stats, delta, runtime.engine.policy.scores())
            else:
                for delta, _ in run:
                    _emit(stdout, delta, stream)
        except KeyboardInterrupt:
            rest = run.interrupt()
            _finish_prompt(opts, run, stdout, stream, rest)
            if state_file is not None:
                save_policy_state(runtime.engine.policy, state_file)
            console.print(f"interrupted · {summary_line(run.stats)}", soft_wrap=True)
            raise CommandExit(EXIT_INTERRUPTED) from None
        _finish_prompt(opts, run, stdout, stream, "")
        if state_file is not None:
            save_policy_state(runtime.engine.policy, state_file)
        if show_panel and out_tty:
            console.print(stats_panel(run.stats, profile.policy.name, runtime.engine.policy.scores()))
        elif opts.stats:
            console.print(summary_line(run.stats), soft_wrap=True)
    return EXIT_OK


def load_policy_state(policy, file: Path) -> None:
    try:
        policy.load_state_dict(json.loads(file.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--policy-state {file}: cannot use it: {exc}") from None


def save_policy_state(policy, file: Path) -> None:
    # Write beside and rename: an interrupted write never leaves a truncated state file.
    partial = file.with_name(file.name + ".partial")
    partial.write_text(json.dumps(policy.state_dict(), indent=1), encoding="utf-8")
    partial.replace(file)


def _emit(stdout: IO[str], text: str, stream: bool) -> None:
    if stream and text:
        stdout.write(text)
        stdout.flush()


def _finish_prompt(opts: GenerateOptions, run: PromptRun, stdout: IO[str], stream: bool, rest: str) -> None:
    if opts.json_output:
        stdout.write(json.dumps(run.record(), ensure_ascii=False) + "\n")
    else:
        text = rest if stream else run.text
        if not (run.text.endswith("\n")):
            text += "\n"
        stdout.write(text)
    stdout.flush()
