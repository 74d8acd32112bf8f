"""Shared terminal plumbing for commands: the stderr console, one-line errors and warnings
(user text printed literally, never as Rich markup), quiet library logging, our own log
lines routed through the console, error-to-exit-code mapping, and the closed-pipe, Ctrl-C
and SIGTERM conventions."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any, Iterator

from rich.console import Console
from rich.text import Text

from specdraft.errors import SpecdraftError, Terminated, UsageError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# SIGTERM handled like Ctrl-C still exits as a SIGTERM'd process is reported (128 + 15):
# what supervisors and scripts test for, and distinct from a user's Ctrl-C (130).
EXIT_TERMINATED = 128 + int(signal.SIGTERM)
MAX_SEED = 2**63 - 1


class CommandExit(Exception):
    def __init__(self, code: int):
        self.code = code


def err_console() -> Console:
    # Redirected stderr (a log file, CI) gets wide tables rather than 80-column wrapping.
    wide = None if sys.stderr.isatty() else 200
    return Console(stderr=True, highlight=False, width=wide)


def labelled(label: str, style: str, message: str) -> Text:
    """`label: message` with only the label styled: messages quote profile keys such as
    `[target]` and user strings such as a drafter named `[/x]`, which Rich markup would
    swallow or choke on."""
    return Text.assemble((label, style), " ", message)


def print_error(console: Console, message: str) -> None:
    console.print(labelled("error:", "red", message), soft_wrap=True)


def warner(console: Console):
    """`warn(message)` for recoverable problems (a skipped dataset line, ...)."""
    return lambda message: console.print(labelled("warning:", "yellow", message), soft_wrap=True)


class _ConsoleHandler(logging.Handler):
    """specdraft's own log lines (a GGUF conversion, a rebuilt cache entry) through the
    console, so they appear above a spinner or progress bar instead of tearing it."""

    def __init__(self, console: Console):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            self.console.print(labelled("warning:", "yellow", message), soft_wrap=True)
        else:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)


def quiet_libraries(verbose: bool, console: Console | None = None) -> None:
    """transformers' progress bars and warnings would clutter stderr around the panel.

    Only environment variables and filters: importing transformers costs seconds, and a
    command that stops at a profile error must not pay for it (models/quiet.py: the model
    loaders apply the same settings when they import it)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logger = logging.getLogger("specdraft")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _ConsoleHandler)]
    if console is not None:
        logger.addHandler(_ConsoleHandler(console))
        logger.setLevel(logging.INFO)
        logger.propagate = False  # printed once, by the console; not again by --verbose's root handler
    if verbose:
        os.environ.pop("SPECDRAFT_QUIET", None)
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
        return
    from specdraft.models.quiet import quiet_environment  # torch-free

    quiet_environment()


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"{flag}: must be between 0 and 2**63 - 1 (got {seed})")


# The decoding flags generate and chat share, each over the profile's value of the same name.
DECODE_FLAGS = ("policy", "draft_tokens", "temperature", "top_k", "top_p", "repeat_penalty", "repeat_last_n",
                "max_new_tokens", "seed")


def decode_flags(opts: Any) -> dict[str, Any]:
    """`opts`' DECODE_FLAGS, for `Profile.with_overrides` (None: the profile's own)."""
    return {name: getattr(opts, name) for name in DECODE_FLAGS}


def check_count(value: int | None, flag: str) -> None:
    """A count the user may leave out (None) but must not give as 0 or negative."""
    if value is not None and value < 1:
        raise UsageError(f"{flag}: must be at least 1 (got {value})")


@contextlib.contextmanager
def exit_codes(console: Console) -> Iterator[None]:
    """One-line errors and the documented exit codes instead of tracebacks."""
    try:
        yield
    except SpecdraftError as exc:
        if os.environ.get("SPECDRAFT_DEBUG"):
            traceback.print_exc()
        print_error(console, str(exc))
        raise CommandExit(exc.exit_code) from None
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        console.print("terminated (SIGTERM)" if terminated else "interrupted", markup=False)
        raise CommandExit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        _silence_stdout()
        raise CommandExit(EXIT_OK) from None
    except CommandExit:
        raise
    except Exception as exc:  # a real failure: one line, traceback only on request
        if os.environ.get("SPECDRAFT_DEBUG"):
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc).strip() else ""
        print_error(console, f"{type(exc).__name__}: {first}")
        raise CommandExit(EXIT_FAILURE) from None


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises `Terminated` (a KeyboardInterrupt) inside the block, so what Ctrl-C
    saves (a training checkpoint) is saved when a job is stopped with `kill` or by a
    scheduler too. Later SIGTERMs are ignored until the block ends: a second one must not
    cut short the save the first one started (SIGKILL still ends the process)."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _silence_stdout() -> None:
    # The reader went away (`| head`): point stdout at /dev/null so the final flush is quiet.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
