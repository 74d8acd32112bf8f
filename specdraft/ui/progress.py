"""The progress bar bench, trace and calibrate-beta show on stderr (never on stdout)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def progress_bar(console: Console, label: str, total: int) -> Iterator[Callable[[str], None]]:
    """Yields `tick(description)`, which advances the bar by one step."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True,
                        redirect_stdout=False, redirect_stderr=False, disable=not console.is_terminal)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda description: progress.update(task, advance=1, description=description)
