"""`specdraft chat`: a multi-turn conversation with one loaded model.

On a terminal: a `> ` prompt with line editing and history (readline; kept under the cache
folder), each answer streamed as it is committed, `/system TEXT`, `/clear`, `/save FILE`,
`/help`, `/exit` (or Ctrl-D). Ctrl-C during an answer stops that answer and keeps what it
said; at the prompt it only clears the line. Piped stdin (scripts): every non-empty line is a
turn, answers are written to stdout each followed by a blank line, or one JSON record per
turn with `--json`.

Each turn renders the whole conversation with the chat template and decodes it; the engine
finds the prefix its target cache already holds (the earlier turns), so only the new turn is
prefilled (`prefill_tokens` in `--json`). After an interrupted answer the cache is not
trusted and the next turn prefills from the start.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_seed, decode_flags
from specdraft.errors import UsageError

HELP = ("/system TEXT  replace the system message (/system alone: the template's default)\n"
        "/clear        forget the conversation\n"
        "/save FILE    write the conversation as JSON\n"
        "/exit         leave (or Ctrl-D); Ctrl-C stops an answer")


@dataclass
class ChatOptions:
    pool: str
    system: str | None = None
    json_output: bool = False
    stats: bool = False
    panel: bool = False  # a one-line live status on stderr while the answer streams
    policy: str | None = None
    draft_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None


@dataclass
class Conversation:
    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)  # (role, text), alternating user / assistant

    def as_json(self) -> dict:
        return {"system": self.system, "messages": [{"role": r, "content": t} for r, t in self.turns]}


def run_chat(opts: ChatOptions, console: Console, stdin: IO[Any] | None = None,
             stdout: IO[str] | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    check_seed(opts.seed)
    from specdraft.profile import load_profile

    profile = load_profile(opts.pool).with_overrides(**decode_flags(opts))
    interactive = stdin.isatty()
    runtime = _load(profile, console)
    from specdraft.session.prompt_ids import has_chat_template

    if not has_chat_template(runtime.tokenizer):
        raise UsageError(f"{profile.target.describe()}: its tokenizer has no chat template; use `generate --raw`")
    conversation = Conversation(opts.system)
    if interactive:
        _history(console)
        console.print(f"chatting with {Path(profile.target.describe()).name} · /help for commands · Ctrl-D to leave",
                      markup=False, highlight=False)
    for text in _lines(stdin, interactive, console):
        if text.startswith("/"):
            if _command(text, conversation, console):
                break
            continue
        _turn(runtime, conversation, text, opts, console, stdout)
    return EXIT_OK


def _load(profile, console: Console):
    from specdraft.runtime import build_runtime
    from specdraft.ui.progress import loading

    with loading(console):
        return build_runtime(profile)


def _lines(stdin: IO[Any], interactive: bool, console: Console) -> Iterator[str]:
    """The user's turns and commands: stripped, empty ones skipped; ends at end of input."""
    while True:
        try:
            line = input("> ") if interactive else stdin.readline()
        except EOFError:
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            console.print("", markup=False)
            continue
        if not interactive and not line:
            return
        line = line.strip()
        if line:
            yield line


def _command(text: str, conversation: Conversation, console: Console) -> bool:
    """Carry out a /command; True when the session ends."""
    name, _, argument = text.partition(" ")
    argument = argument.strip()
    say: Callable[[str], None] = lambda message: console.print(message, markup=False, highlight=False)  # noqa: E731
    if name in ("/exit", "/quit", "/bye"):
        return True
    if name == "/system":
        conversation.system = argument or None
        say("system message set" if argument else "system message: the template's default")
    elif name == "/clear":
        conversation.turns.clear()
        say("conversation cleared")
    elif name == "/save":
        if not argument:
            say("/save needs a file name")
        else:
            from specdraft.storage.atomic_files import write_text

            try:
                write_text(Path(argument).expanduser(), json.dumps(conversation.as_json(), indent=1,
                                                                   ensure_ascii=False) + "\n")
                say(f"saved {len(conversation.turns)} messages to {argument}")
            except OSError as exc:
                say(f"cannot save to {argument}: {exc.strerror or exc}")
    elif name == "/help":
        say(HELP)
    else:
        say(f"unknown command {name}; /help lists them")
    return False


def _turn(runtime, conversation: Conversation, text: str, opts: ChatOptions, console: Console, stdout: IO[str]) -> None:
    from specdraft.session.prompt_ids import ChatFrame
    from specdraft.session.prompt_run import PromptRun
    from specdraft.ui.panel import compact_line, summary_line

    try:
        run = PromptRun(runtime, text, True, frame=ChatFrame(conversation.system, tuple(conversation.turns)))
    except UsageError as exc:  # too long for the context: the session goes on
        console.print(f"error: {exc}", markup=False, highlight=False)
        return
    # On a terminal shared with the status line, the line's view shows the text as it comes
    # and the answer is printed once the view is gone (as generate's panel does).
    in_view = opts.panel and stdout.isatty() and not opts.json_output
    stream = not opts.json_output and not in_view
    try:
        with _view(opts.panel, console, runtime, in_view) as view:
            for delta, _ in run:
                if stream and delta:
                    stdout.write(delta)
                    stdout.flush()
                view(run.stats, delta)
    except KeyboardInterrupt:
        rest = run.interrupt()
        if stream:
            stdout.write(rest)
        runtime.engine.prefix.forget()  # an interrupt may land mid-forward: the next turn starts afresh
        console.print("\n(answer stopped)", markup=False)
    if in_view:
        stdout.write(run.text)
    if opts.json_output:
        stdout.write(json.dumps({"turn": len(conversation.turns) // 2 + 1, **run.record()}, ensure_ascii=False) + "\n")
    else:
        stdout.write("\n" if run.text.endswith("\n") else "\n\n")
    stdout.flush()
    conversation.turns += [("user", text), ("assistant", run.text)]
    if opts.panel:  # the line's last state stays, under the answer
        console.print(compact_line(run.stats))
    if opts.stats:
        console.print(summary_line(run.stats) + f" · prefilled {run.stats.prefill_tokens} tokens",
                      soft_wrap=True, markup=False)


@contextlib.contextmanager
def _view(panel: bool, console: Console, runtime, show_text: bool) -> Iterator[Callable[[Any, str], None]]:
    """`update(stats, delta)` for the compact live status line, or one that does nothing."""
    if not panel:
        yield lambda stats, delta: None
        return
    from specdraft.ui.panel import LiveView

    with LiveView(console, runtime.profile.policy.name, show_text, compact=True) as view:
        yield view.update


def _history(console: Console) -> None:
    """Line editing and a history kept between sessions, where readline exists."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    from specdraft.storage.cache_root import cache_dir

    file = cache_dir() / "chat-history"
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        if file.is_file():
            readline.read_history_file(str(file))
    except OSError:
        return
    readline.set_history_length(1000)
    atexit.register(lambda: _save_history(readline, file))


def _save_history(readline, file: Path) -> None:
    try:
        readline.write_history_file(str(file))
    except OSError:
        pass
