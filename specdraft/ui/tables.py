"""Rich tables for bench, replay and calibrate-beta results (bench's on stdout, the others on
stderr)."""

from __future__ import annotations

from typing import Sequence

from rich.markup import escape
from rich.table import Table


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COMPACT = ("task", "config", "prompts", "speedup", "simulated speedup", "mean accepted", "tok/s", "mismatches")
SHORT = {"simulated speedup": "sim. speedup", "mean accepted": "accepted", "mismatches": "differ"}  # compact headers


def bench_table(rows: Sequence[dict], title: str, simulated: bool = False, versus: str | None = None,
                wide: bool = False) -> Table:
    """bench's summary; with `versus`, a column of each row's speed over that configuration's.
    Compact (fits 100 columns) unless `wide`: then also acceptance by position, best-arm
    share, regret, the ideal, the time split, draft lengths and trees."""
    table = Table(title=escape(title), title_justify="left", show_lines=False)  # titles quote file names
    versus_column = f"vs {versus}" if versus else None
    # (a column only when some round verified a tree: several chains, or runner-up leaves)
    trees = any(r.get("tree_share") or r.get("runner_up_share") for r in rows)
    cells = [_bench_cells(r, simulated, versus_column, trees) for r in rows]
    shown = [column for column in (cells[0] if cells else _bench_cells({}, simulated, versus_column, trees))
             if (wide or column in COMPACT or column == versus_column) and not (simulated and column == "tok/s")]
    for column in shown:
        left = column in ("task", "config", "acceptance by position", "K: rounds", "tree size: rounds", "trees · won")
        table.add_column(escape(column if wide else SHORT.get(column, column)), justify="left" if left else "right",
                         no_wrap=True)
    for r, row_cells in zip(rows, cells):
        table.add_row(*(row_cells[column] for column in shown), style="bold" if r["task"] == "all" else None)
    return table


def _bench_cells(r: dict, simulated: bool, versus_column: str | None, trees: bool) -> dict[str, str]:
    """One row of bench's table: every column's cell, by column, in the wide table's order."""
    accept = "/".join("-" if a is None else f"{a:.0%}" for a in r.get("acceptance_at") or [])
    mismatches = r.get("mismatches")
    # a peer engine's row: the share of prompts with the same text as plain decoding
    differ = _num(r.get("identical"), ".0%") + " same" if r.get("identical") is not None else \
        "-" if mismatches is None else (f"[bold red]{mismatches}[/]" if mismatches else "0")
    if r.get("failed"):
        differ += f" [bold red]{r['failed']} failed[/]"
    # "?": a speedup bench.summarize marked noisy or implausible (a warning line says why).
    doubt = "?" if r.get("noisy") or r.get("implausible") else ""
    cells = {"task": escape(str(r.get("task", ""))), "config": escape(r.get("config", "")),
             "prompts": str(r.get("prompts", "")),
             "simulated speedup" if simulated else "speedup": _num(r.get("speedup"), ".2f") + "x" + doubt}
    if versus_column:
        cells[versus_column] = _num(r.get("versus"), ".2f") + ("x" if r.get("versus") is not None else "")
    cells |= {"mean accepted": _num(r.get("mean_accepted"), ".2f"), "acceptance by position": accept or "-",
              "tok/s": _num(r.get("tokens_per_s"), ".1f") if not simulated else "-",
              "best-arm share": _num(r.get("best_arm_share"), ".0%"),
              "regret": _regret(r.get("regret"), r.get("regret_unit")), "mismatches": differ,
              "ideal": _num(r.get("ideal_speedup"), ".2f") + ("x" if r.get("ideal_speedup") is not None else ""),
              "time d/v/e/p/o": _split(r.get("time_share")),
              "tree size: rounds" if trees else "K: rounds": _lengths(r.get("draft_lengths"))}
    if trees:
        cells["trees · won"] = _trees(r)
    return cells


def _regret(value: float | None, unit: str | None) -> str:
    """A regret with its unit: the objective the policy optimises ("tokens" or "tok/s")."""
    if value is None:
        return "-"
    return f"{value:.2f} {unit}" if unit else f"{value:.2f}"


def _split(share: dict | None) -> str:
    """Percent of wall time in draft / verify / evaluate / prompt prefill / everything else."""
    if not share:
        return "-"
    phases = ("draft", "verify", "evaluate", "prefill", "other")
    return "/".join(f"{100 * share.get(phase, 0.0):.0f}" for phase in phases)


def _trees(row: dict) -> str:
    """The share of rounds that verified a tree, chains per round, and the drafters whose
    branch won most often (share of tree rounds); then the share of rounds with runner-up
    leaves and how often the committed tokens ended on one."""
    share, leaves = row.get("tree_share"), row.get("runner_up_share")
    cells = []
    if share:
        wins = ", ".join(f"{escape(name)} {value:.0%}" for name, value in list((row.get("wins") or {}).items())[:2])
        cells.append(f"{share:.0%} · {row.get('branches_per_round') or 0:.2f} · {wins or '-'}")
    if leaves:
        cells.append(f"leaves {leaves:.0%} · won {row.get('runner_up_wins') or 0:.0%}")
    return "; ".join(cells) or "-"


def _lengths(lengths: dict | None) -> str:
    """How many rounds drafted each length, the most common first (at most four shown)."""
    if not lengths:
        return "-"
    top = sorted(lengths.items(), key=lambda kv: -kv[1])[:4]
    return " ".join(f"{k}:{n}" for k, n in sorted(top, key=lambda kv: int(kv[0])))


def sweep_table(policy: str, param: str, rows, best, paper: float | None) -> Table:
    table = Table(title=f"{policy}.{param} sweep (replayed)", title_justify="left")
    for column in (param, "mean accepted", "simulated speedup", "regret", ""):
        table.add_column(column, justify="right")
    for r in rows:
        mark = "best" if r is best else ("paper" if paper is not None and r.value == paper else "")
        table.add_row(f"{r.value:g}", f"{r.tokens_per_round:.3f}", f"{r.simulated_speedup:.3f}x",
                      _regret(r.regret, r.regret_unit), mark, style="bold" if r is best else None)
    return table


def vllm_table(rows: Sequence[dict], title: str) -> Table:
    """`bench --engine vllm`: one row per concurrency and configuration (with several runs
    each, the tokens/s over all of them and each run's beside it)."""
    table = Table(title=title, title_justify="left")
    several = any(len(row.get("per_run") or ()) > 1 for row in rows)
    headers = ["requests in flight", "configuration", "tokens/s", "× vLLM plain", "× best built-in",
               "latency median s", "latency p95 s", "differing"] + (["tokens/s per run"] if several else [])
    for header in headers:
        table.add_column(header, justify="left" if header == "configuration" else "right")
    for row in rows:
        cells = [str(row["concurrency"]), row["config"], _num(row["tokens_per_s"], ".1f"),
                 _num(row.get("vs_plain"), ".2f"), _num(row.get("vs_best_built_in"), ".2f"),
                 _num(row["latency_median"], ".2f"), _num(row["latency_p95"], ".2f"), _num(row.get("differing"), "d")]
        if several:
            cells.append(" / ".join(f"{rate:.1f}" for rate in row.get("per_run") or ()))
        table.add_row(*cells)
    return table


def hindsight_table(bounds: Sequence[dict]) -> Table:
    """`bench --replay`: per task, each drafter and the whole pool with every round's
    drafter and draft length chosen knowing its outcome (`measurement.replay.hindsight`)."""
    names = list(bounds[0]["drafters"])
    table = Table(title="in hindsight: every round's drafter and draft length chosen knowing its outcome "
                        "(simulated speedup; no policy over these drafters can beat the pool's)",
                  title_justify="left")
    for header in ["task", *names, "pool", "pool / best drafter"]:
        table.add_column(escape(header), justify="left" if header == "task" else "right")
    for row in bounds:
        table.add_row(escape(row["task"]), *(f"{row['drafters'][name]:.2f}x" for name in names), f"{row['pool']:.2f}x",
                      f"{_num(row['pool_over_best'], '.3f')} ({escape(row['best_drafter'])})")
    return table
