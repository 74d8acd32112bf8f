"""Kill a writer at many points of its work and look at what it left.

`kill_points(action, n)` runs `action` once in a forked child to count the Python lines it
executes, then picks n points spread over that run. `run_killed(action, at)` runs it again
in a fresh fork and SIGKILLs the child when it reaches line `at`: no `finally`, no atexit,
no buffered write is flushed, as with `kill -9` or a power cut of the process.

Only lines of specdraft's own modules count: every state on disk changes between two of
them, and counting numpy's or shutil's lines too would spread the points so thin that a
window of a few of ours (between publishing a store and deleting what it replaced) is
missed. Kills inside a library call still happen (a line of ours that calls np.save is
killed after its call when the next line is reached), and writes in progress are what the
staging under atomic_files.py is for.

Forking keeps each run to milliseconds (no interpreter start, no re-import); the child
only touches files, never torch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

_OURS = str(Path(__file__).resolve().parents[1] / "specdraft")


def _run_child(action: Callable[[], None], kill_at: int | None, count_fd: int | None) -> None:
    seen = 0

    def tracer(frame, event, arg):
        nonlocal seen
        if event == "call":
            return tracer if _OURS in frame.f_code.co_filename else None
        if event == "line":
            seen += 1
            if kill_at is not None and seen >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    try:
        sys.settrace(tracer)
        action()
        sys.settrace(None)
        if count_fd is not None:
            os.write(count_fd, str(seen).encode())
        code = 0
    except BaseException:  # noqa: BLE001 - the parent sees a failed run by its exit status
        sys.settrace(None)
        import traceback

        traceback.print_exc()
        code = 3
    os._exit(code)


def _fork(action: Callable[[], None], kill_at: int | None, count_fd: int | None) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_child(action, kill_at, count_fd)
    _, status = os.waitpid(pid, 0)
    return status


def lines_run(action: Callable[[], None]) -> int:
    """How many Python lines an uninterrupted run of `action` executes (in a child)."""
    read_fd, write_fd = os.pipe()
    status = _fork(action, None, write_fd)
    os.close(write_fd)
    out = os.read(read_fd, 64)
    os.close(read_fd)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        raise AssertionError(f"the uninterrupted run failed (status {status})")
    return int(out)


def kill_points(action: Callable[[], None], count: int) -> list[int]:
    """`count` line numbers spread evenly over a run of `action` (first and last included)."""
    total = lines_run(action)
    assert total >= count, f"the action runs only {total} lines"
    return sorted({max(1, round(1 + i * (total - 1) / (count - 1))) for i in range(count)})


def run_killed(action: Callable[[], None], at: int) -> bool:
    """Run `action` in a child killed at its `at`-th line; True when the kill happened."""
    status = _fork(action, at, None)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the run failed before its kill point (status {status})"
    return False
