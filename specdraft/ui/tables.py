"""Rich tables for bench, replay and calibrate-beta results (printed to stderr)."""

from __future__ import annotations

from typing import Sequence

from rich.markup import escape
from rich.table import Table


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def bench_table(rows: Sequence[dict], title: str, simulated: bool = False) -> Table:
    table = Table(title=escape(title), title_justify="left", show_lines=False)  # titles quote file names
    for column in ("task", "config", "prompts", "simulated speedup" if simulated else "speedup", "mean accepted",
                   "acceptance by position", "tok/s", "best-arm share", "regret", "mismatches"):
        table.add_column(column, justify="left" if column in ("task", "config", "acceptance by position") else "right",
                         no_wrap=True)
    for r in rows:
        accept = "/".join("-" if a is None else f"{a:.0%}" for a in r.get("acceptance_at") or [])
        mismatches = r.get("mismatches")
        # "?": a speedup bench.summarize marked noisy or implausible (a warning line says why).
        doubt = "?" if r.get("noisy") or r.get("implausible") else ""
        table.add_row(
            escape(str(r["task"])), escape(r["config"]), str(r["prompts"]), _num(r.get("speedup"), ".2f") + "x" + doubt,
            _num(r.get("mean_accepted"), ".2f"), accept or "-",
            _num(r.get("tokens_per_s"), ".1f") if not simulated else "-",
            _num(r.get("best_arm_share"), ".0%"), _num(r.get("regret"), ".2f"),
            "-" if mismatches is None else (f"[bold red]{mismatches}[/]" if mismatches else "0"),
            style="bold" if r["task"] == "all" else None,
        )
    return table


def sweep_table(policy: str, param: str, rows, best, paper: float | None) -> Table:
    table = Table(title=f"{policy}.{param} sweep (replayed)", title_justify="left")
    for column in (param, "mean accepted", "simulated speedup", "regret", ""):
        table.add_column(column, justify="right")
    for r in rows:
        mark = "best" if r is best else ("paper" if paper is not None and r.value == paper else "")
        table.add_row(f"{r.value:g}", f"{r.mean_accepted:.3f}", f"{r.simulated_speedup:.3f}x",
                      _num(r.regret, ".2f"), mark, style="bold" if r is best else None)
    return table
