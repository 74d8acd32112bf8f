"""`specdraft generate`: prompts in, text (or JSON lines) out on stdout, panel on stderr.

Everything the user typed is checked before a model loads (and before torch or
transformers are imported where possible): the profile, the flags, the policy-state file
(also against the profile's policy, pool and draft length).
With `--each-line` a line that cannot be used (not UTF-8, too long for the context) is
reported with its number and skipped; the rest still run and the command exits 1 at the
end. `--keep-empty` answers empty and unusable lines too, so output line N belongs to
input line N.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator

from rich.console import Console

from specdraft.commands.io import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, CommandExit, check_seed, decode_flags,
                                   print_error, warner)
from specdraft.commands.outputs import atomic_write_text, check_writable
from specdraft.commands.prompts import Line, read_prompts
from specdraft.storage.regular_files import read_regular_text
from specdraft.errors import UsageError

if TYPE_CHECKING:
    from specdraft.profile import Profile
    from specdraft.runtime import Runtime


@dataclass
class GenerateOptions:
    pool: str
    prompt: str | None = None
    each_line: bool = False
    keep_empty: bool = False
    json_output: bool = False
    chat: bool | None = None
    panel: bool | None = None
    stats: bool = False
    policy: str | None = None
    draft_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    max_new_tokens: int | None = None
    truncate: bool = False
    seed: int | None = None
    policy_state: str | None = None  # JSON file: load the learned policy state, save it back
    system: str | None = None  # the chat's system message (replaces the template's default)
    stop: list[str] | None = None  # more stop strings, after the profile's
    separator: str | None = None  # written after every --each-line answer (escapes allowed); None: a blank line


def run_generate(opts: GenerateOptions, console: Console, stdout: IO[str] | None = None,
                 stdin: IO[Any] | None = None) -> int:
    stdout, stdin = stdout or sys.stdout, stdin or sys.stdin  # looked up now: tests swap them
    profile, saved_state = _checked_profile(opts)
    lines = read_prompts(opts.prompt, opts.each_line, stdin)
    ahead = _read_ahead(lines)
    out_tty = stdout.isatty()
    show_panel = opts.panel if opts.panel is not None else (console.is_terminal and out_tty and not opts.json_output)
    runtime = _load(opts, profile, saved_state, console)
    failures = 0
    for line in itertools.chain(ahead, lines):
        if line.error is not None or not line.text.strip():
            failures += _skip(opts, line, console, stdout)
            continue
        try:
            run = _start(runtime, line, opts, console)
        except UsageError as exc:
            if not opts.each_line:
                raise
            failures += _skip(opts, Line(line.number, line.text, str(exc)), console, stdout)
            continue
        _generate(opts, runtime, run, line, console, stdout, show_panel, out_tty)
    if failures:
        print_error(console, f"{failures} input line{'s' if failures > 1 else ''} could not be used (see above)")
        return EXIT_FAILURE
    return EXIT_OK


def _checked_profile(opts: GenerateOptions) -> tuple[Profile, dict | None]:
    """The profile with the flags over it, and the saved policy state (None without one),
    checked before torch loads."""
    check_seed(opts.seed)
    if opts.keep_empty and not opts.each_line:
        raise UsageError("--keep-empty only applies with --each-line")
    if opts.separator is not None and not (opts.each_line and not opts.json_output):
        raise UsageError("--separator only applies to --each-line plain text (--json is one record per line)")
    if not Path(opts.pool).exists():  # the commonest first mistake, answered before torch loads
        raise UsageError(f"{opts.pool}: profile file not found")
    saved_state = read_policy_state(opts.policy_state)
    from specdraft.profile import load_profile

    if any(not s for s in opts.stop or ()):
        raise UsageError("--stop: an empty stop string would end every answer at once")
    base = load_profile(opts.pool)
    profile = base.with_overrides(**decode_flags(opts), stop=(*base.decode.stop, *opts.stop) if opts.stop else None)
    if saved_state is not None:
        check_policy_state(profile, saved_state, opts.policy_state)
    return profile, saved_state


def _read_ahead(lines: Iterator[Line]) -> list[Line]:
    """Read up to the first line with something in it before loading models: input with no
    prompt at all is a usage error, and is answered without the wait."""
    ahead: list[Line] = []
    for line in lines:
        ahead.append(line)
        if line.error is not None or line.text.strip():
            return ahead
    raise UsageError(f"stdin held no prompt ({len(ahead)} empty line{'' if len(ahead) == 1 else 's'})"
                     if ahead else "stdin is empty: no prompt")


def _load(opts: GenerateOptions, profile: Profile, saved_state: dict | None, console: Console) -> Runtime:
    """The runtime, with the saved policy state loaded into its policy driver."""
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_ids import check_budget, context_limit
    from specdraft.ui.progress import loading

    with loading(console):
        runtime = build_runtime(profile)
    check_budget(context_limit(runtime))
    if saved_state is not None:
        load_policy_state(runtime.engine.driver, saved_state, opts.policy_state, runtime.profile.decode.draft_tokens)
    return runtime


def _start(runtime, line: Line, opts: GenerateOptions, console: Console):
    from specdraft.session.prompt_ids import ChatFrame
    from specdraft.session.prompt_run import PromptRun

    run = PromptRun(runtime, line.text, opts.chat, truncate=opts.truncate, frame=ChatFrame(opts.system))
    if run.truncated:
        where = f"stdin line {line.number}: " if line.number else ""
        warner(console)(f"{where}the prompt was cut to its last {len(run.prompt_ids)} tokens "
                        f"({run.truncated} characters dropped) to fit the context")
    return run


def _skip(opts: GenerateOptions, line: Line, console: Console, stdout: IO[str]) -> int:
    """An empty line is skipped quietly; an unusable one is reported. With --keep-empty
    both still get their output line. Returns 1 for a failure, 0 for an empty line."""
    if line.error is not None:
        print_error(console, f"stdin line {line.number}: {line.error}; skipped")
    if opts.keep_empty:
        record = {"line": line.number, "prompt": line.text or "", "text": "", "finish_reason": "empty"}
        if line.error is not None:
            record.update(finish_reason="error", error=line.error)
        stdout.write(json.dumps(record, ensure_ascii=False) + "\n" if opts.json_output else "\n" + separator(opts))
        stdout.flush()
    return int(line.error is not None)


def _generate(opts: GenerateOptions, runtime, run, line: Line, console: Console, stdout: IO[str],
              show_panel: bool, out_tty: bool) -> None:
    from specdraft.ui.panel import LiveView, stats_panel, summary_line

    policy = runtime.engine.policy
    # Text streams straight to stdout unless the panel shares its terminal: then the
    # panel shows it live and it is printed whole once the panel is gone.
    stream = not opts.json_output and not (show_panel and out_tty)
    try:
        if show_panel:
            with LiveView(console, runtime.profile.policy.name, show_text=out_tty and not opts.json_output) as view:
                for delta, _ in run:
                    _emit(stdout, delta, stream)
                    view.update(run.stats, delta, policy.scores())
        else:
            for delta, _ in run:
                _emit(stdout, delta, stream)
    except KeyboardInterrupt:
        rest = run.interrupt()
        finish_prompt(opts, run, line, stdout, stream, rest)
        if opts.policy_state:
            save_policy_state(runtime.engine.driver, Path(opts.policy_state))
        console.print(f"interrupted · {summary_line(run.stats)}", soft_wrap=True, markup=False)
        raise CommandExit(EXIT_INTERRUPTED) from None
    finish_prompt(opts, run, line, stdout, stream, "")
    if opts.policy_state:
        save_policy_state(runtime.engine.driver, Path(opts.policy_state))
    if show_panel and out_tty:
        console.print(stats_panel(run.stats, runtime.profile.policy.name, policy.scores()))
    elif opts.stats:
        console.print(summary_line(run.stats), soft_wrap=True, markup=False)


def read_policy_state(file: str | None) -> dict | None:
    """The saved state to start from (None when there is no file yet), checked before any
    model loads; the file must also be writable, since the state is saved back."""
    if not file:
        return None
    path = Path(file)
    check_writable("--policy-state", path)
    if not path.exists():
        return None
    try:
        state = json.loads(read_regular_text(path, limit=64 << 20))
    except (OSError, ValueError, RecursionError) as exc:
        cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"--policy-state {file}: cannot read it: {cause}") from None
    if not isinstance(state, dict):
        raise UsageError(f"--policy-state {file}: expected a JSON object as written by specdraft, "
                         f"got {type(state).__name__}")
    return state


def check_policy_state(profile, state: dict, file: str) -> None:
    """Load `state` into a policy built as the runtime will build it (policies are plain
    Python: no model needed), so a state saved with another policy, pool or -k is refused
    before the models load. An optional drafter may be left out of the pool at load time:
    a state saved without some optional drafters is checked against that pool."""
    from specdraft.learning.driver import PolicyDriver
    from specdraft.learning.policies import build_policy

    names = profile.arms
    optional = {d.name for d in profile.drafters if getattr(d.options, "optional", False)}
    saved = state.get("arms")
    arms = names
    if isinstance(saved, list) and all(isinstance(a, str) for a in saved) and set(saved) <= set(names) \
            and set(names) - set(saved) <= optional and saved == [a for a in names if a in saved]:
        arms = saved
    try:
        policy = build_policy(profile.policy.name, profile.policy.options, arms, seed=0,
                              draft_tokens=profile.decode.draft_tokens, horizon=profile.decode.max_new_tokens)
    except Exception:  # a pool the runtime will refuse anyway (a fixed drafter left out): it says why
        return
    driver = PolicyDriver(policy, profile.decode.draft_tokens, profile.decode.max_new_tokens)
    load_policy_state(driver, state, file, profile.decode.draft_tokens)


def load_policy_state(driver, state: dict, file: str, draft_tokens: int | None = None) -> None:
    """Load `state` into `driver` (its policy's learner state and its planner's costs and
    acceptance), or a UsageError naming the file."""
    policy, saved_k = driver.policy, _saved_draft_tokens(state)
    if draft_tokens is not None and saved_k is not None and saved_k != draft_tokens \
            and state.get("policy") == policy.name and state.get("arms") == policy.arms:
        raise UsageError(f"--policy-state {file}: saved by a run drafting up to {saved_k} tokens (-k / draft_tokens), "
                         f"this one drafts up to {draft_tokens}; use the same -k or another state file")
    try:
        driver.load_state_dict(state)
    except Exception as exc:  # any shape of garbage in a saved state is the file's fault
        raise UsageError(f"--policy-state {file}: cannot use it: {exc}") from None


def _saved_draft_tokens(state: dict) -> int | None:
    """The K a state was saved with: the length of its acceptance-by-position rows."""
    inner = state.get("state")
    acceptance = inner.get("acceptance") if isinstance(inner, dict) else None
    rows = acceptance.get("hits") if isinstance(acceptance, dict) else None
    if isinstance(rows, list) and rows and isinstance(rows[0], list):
        return len(rows[0])
    return None


def save_policy_state(driver, file: Path) -> None:
    # Written beside and renamed: an interrupted write never leaves a truncated state file.
    atomic_write_text(file, json.dumps(driver.state_dict(), indent=1))


def _emit(stdout: IO[str], text: str, stream: bool) -> None:
    if stream and text:
        stdout.write(text)
        stdout.flush()


def finish_prompt(opts: GenerateOptions, run, line: Line, stdout: IO[str], stream: bool, rest: str) -> None:
    """Write what a finished prompt owes stdout: its JSON record, or the rest of its text."""
    if opts.json_output:
        record = run.record()
        if line.number:
            record = {"line": line.number, **record}
        stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        text = rest if stream else run.text
        if not (run.text.endswith("\n")):
            text += "\n"
        stdout.write(text + separator(opts))
    stdout.flush()


def separator(opts: GenerateOptions) -> str:
    """What follows an answer's last line in plain text: with --each-line, --separator (a
    blank line by default, so that multi-line answers stay apart); nothing for one prompt."""
    if not opts.each_line:
        return ""
    if opts.separator is None:
        return "\n"
    return opts.separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
