"""Shared terminal plumbing for commands: the stderr console, quiet library logging,
error-to-exit-code mapping, and the closed-pipe and Ctrl-C conventions."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import Iterator

from rich.console import Console

from specdraft.errors import SpecdraftError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandExit(Exception):
    def __init__(self, code: int):
        self.code = code


def err_console() -> Console:
    # Redirected stderr (a log file, CI) gets wide tables rather than 80-column wrapping.
    wide = None if sys.stderr.isatty() else 200
    return Console(stderr=True, highlight=False, width=wide)


def warner(console: Console):
    """`warn(message)` for recoverable problems (a skipped dataset line, ...)."""
    return lambda message: console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)


def quiet_libraries(verbose: bool) -> None:
    """transformers' progress bars and warnings would clutter stderr around the panel."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
        return
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import warnings

    warnings.filterwarnings("ignore")


@contextlib.contextmanager
def exit_codes(console: Console) -> Iterator[None]:
    """One-line errors and the documented exit codes instead of tracebacks."""
    try:
        yield
    except SpecdraftError as exc:
        console.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        raise CommandExit(exc.exit_code) from None
    except KeyboardInterrupt:
        console.print("interrupted")
        raise CommandExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        _silence_stdout()
        raise CommandExit(EXIT_OK) from None
    except CommandExit:
        raise
    except Exception as exc:  # a real failure: one line, traceback only on request
        if os.environ.get("SPECDRAFT_DEBUG"):
            traceback.print_exc()
        console.print(f"[red]error:[/] {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      soft_wrap=True)
        raise CommandExit(EXIT_FAILURE) from None


def _silence_stdout() -> None:
    # The reader went away (`| head`): point stdout at /dev/null so the final flush is quiet.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
