"""The progress bench, trace and calibrate-beta show on stderr (never on stdout).

On a terminal: a transient Rich bar. Elsewhere (a CI log, nohup, a pipe) a bar draws
nothing, so `note` prints one plain line instead, with the elapsed time: a long run still
says how far it got. Descriptions are user text (prompt ids, drafter names) and are
escaped, never read as markup.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Ticker:
    """`tick(description)` advances the bar one step; `note(text)` reports a finished unit
    of work (a prompt) as a plain line when there is no bar to show it."""

    def __init__(self, console: Console, progress: Progress, task, label: str):
        self.console, self.progress, self.task, self.label = console, progress, task, label
        self.start = time.perf_counter()

    def tick(self, description: str) -> None:
        self.progress.update(self.task, advance=1, description=escape(description))

    __call__ = tick

    def note(self, text: str) -> None:
        if not self.console.is_terminal:
            elapsed = time.perf_counter() - self.start
            self.console.print(f"{self.label}: {text} · {elapsed:.1f}s elapsed", markup=False, highlight=False,
                               soft_wrap=True)


@contextlib.contextmanager
def progress_bar(console: Console, label: str, total: int) -> Iterator[Ticker]:
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True,
                        redirect_stdout=False, redirect_stderr=False, disable=not console.is_terminal)
    with progress:
        task = progress.add_task(escape(label), total=total)
        yield Ticker(console, progress, task, label)


SHOW_AFTER_S = 2.0  # a load that takes longer than this shows how far it got


@contextlib.contextmanager
def loading(console: Console, label: str = "loading models…") -> Iterator[None]:
    """While models load: a spinner on a terminal, which becomes a bar of the weights read
    once a model's tensors have taken SHOW_AFTER_S (models/gguf_loading.LOAD_PROGRESS).
    Nothing is drawn elsewhere (the log says what loads)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    from specdraft.models.gguf_loading import LOAD_PROGRESS

    if not console.is_terminal:
        yield
        return
    began = time.perf_counter()
    with console.status(label) as status:
        def report(done: int, total: int) -> None:
            if time.perf_counter() - began < SHOW_AFTER_S or total <= 0:
                return
            row = Table.grid(padding=(0, 1))
            row.add_row(label, ProgressBar(total=total, completed=done, width=30),
                        f"{done / total:4.0%} of {total / 1e9:.1f} GB")
            status.update(row)

        token = LOAD_PROGRESS.set(report)
        try:
            yield
        finally:
            LOAD_PROGRESS.reset(token)
