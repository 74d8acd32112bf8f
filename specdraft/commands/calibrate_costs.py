"""`specdraft calibrate costs`: time the target's verify forward at every width again, on a
quiet machine, and keep the curve the round planner plans with (models/width_costs.py).

Each run checks a stored curve against a quick timing and re-measures one that disagrees;
this command is for the user who knows the machine was busy when it was measured, or who
wants to see the curve. The table goes to stdout (width, milliseconds, per token), what was
kept or why not to stderr.
"""

from __future__ import annotations

import sys
from typing import IO

from rich.console import Console

from specdraft.commands.io import EXIT_FAILURE, EXIT_OK


def run_calibrate_costs(pool: str, console: Console, stdout: IO[str] | None = None) -> int:
    from specdraft.models.width_costs import stored, width_costs
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime
    from specdraft.ui.progress import loading

    stdout = stdout or sys.stdout
    profile = load_profile(pool).with_overrides(verify_costs="line")  # the runtime measures nothing itself
    with loading(console):
        runtime = build_runtime(profile, plain=True)
    lm, widths = runtime.engine.target, profile.decode.draft_tokens + 1
    seconds = width_costs(lm, widths, fresh=True)
    stdout.write("width\tms\tms/token\n")
    for width, cost in enumerate(seconds, start=1):
        stdout.write(f"{width}\t{cost * 1e3:.3f}\t{cost * 1e3 / width:.3f}\n")
    stdout.flush()
    file, kept = stored(lm, widths)
    if kept == seconds:
        console.print(f"kept in {file}: later runs plan with it", markup=False, highlight=False)
        return EXIT_OK
    console.print("not kept (see the warning above): run it again when the machine is quiet", markup=False,
                  highlight=False)
    return EXIT_FAILURE
