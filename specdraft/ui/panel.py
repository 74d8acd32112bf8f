"""The live panel on stderr: current drafter, accepted length, mean accepted tokens,
tokens/s, the last round's token tree (its size, branches, and whose branch won),
per-drafter usage (with trees: how often each drafted a branch and how often it won) and
the regret slot (in the unit of the policy's objective:
accepted tokens or tokens per second).

Rich's Live redirects stdout by default, which would swallow the generated text; here it
never does. When stdout is the same terminal, the view also shows the tail of the text
and the caller prints the text once the panel is gone.
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specdraft.session.stats import GenerationStats


def stats_panel(stats: GenerationStats, policy: str, scores: dict[str, float] | None = None,
                title: str = "specdraft") -> Panel:
    regret = stats.regret
    # One wrapping line rather than a grid: a narrow or non-terminal stderr must not
    # truncate the numbers to ellipses. Drafter names are user text: escaped, never markup.
    parts = [
        f"drafter [bold cyan]{escape(stats.last_drafter or '-')}[/]",
        f"K [bold]{stats.last_planned}[/]",
        f"accepted [bold]{stats.last_accepted}/{stats.last_drafted}[/]",
    ]
    if stats.last_branches > 1 or stats.last_runner_ups:
        leaves = f"{stats.last_runner_ups} runner-up leaves, " if stats.last_runner_ups else ""
        parts.append(f"tree [bold]{stats.last_tree_size}[/] ({stats.last_branches} branches, {leaves}"
                     f"won by {escape(stats.last_winner or 'none')})")
    parts += [
        f"mean accepted [bold]{stats.tokens_per_round:.2f}[/]",
        f"[bold]{stats.tokens_per_s:.1f}[/] tok/s",
        f"tokens {stats.tokens}",
    ]
    parts.extend(_speed_parts(stats))
    if stats.tree_rounds:
        parts.append(f"trees {stats.tree_share:.0%} of rounds, {stats.branches_per_round:.2f} branches a round")
    if stats.runner_up_rounds:
        parts.append(f"runner-up leaves in {stats.runner_up_rounds / stats.rounds:.0%} of rounds, "
                     f"won {stats.runner_up_wins / stats.runner_up_rounds:.0%}")
    if regret is not None:
        parts.append(f"regret [bold]{regret:.2f}[/] {regret_unit_phrase(stats.regret_unit, stats.regret_rounds)} "
                     f"(best {escape(str(stats.best_drafter))})")
    elif stats.regret_tracker is not None:  # full information, no round valued yet
        parts.append("regret [dim]not yet known[/]")
    elif policy != "fixed":  # a fixed drafter makes no choice, so there is no regret to know
        parts.append("regret [dim]unknown (bandit feedback)[/]")
    head = Text.from_markup(" · ".join(parts))
    table = Table(box=None, padding=(0, 2), show_edge=False)
    trees = stats.tree_rounds > 0
    for column in ("drafter", "rounds", "share", "acceptance") + (("branched", "won") if trees else ()):
        table.add_column(column, justify="left" if column == "drafter" else "right")
    if scores is not None:
        table.add_column("score", justify="right")
    for name, use in stats.usage.items():
        share = use.rounds / stats.rounds if stats.rounds else 0.0
        row = [escape(name), str(use.rounds), f"{share:.0%}", f"{use.acceptance:.0%}" if use.drafted else "-"]
        if trees:
            row += [str(use.branched), f"{use.won / use.branched:.0%}" if use.branched else "-"]
        if scores is not None:
            value = scores.get(name, float("nan"))
            row.append(f"{value:.3f}" if value == value and abs(value) != float("inf") else "-")
        table.add_row(*row, style="bold" if name == stats.last_drafter else None)
    return Panel(Group(head, table), title=escape(f"{title} · policy {policy}"), title_align="left",
                 border_style="blue")


def regret_unit_phrase(unit: str | None, rounds: int | None) -> str:
    """What a regret number counts: expected accepted tokens, or tokens per second summed
    over the evaluated rounds (the unit of the objective the policy optimises)."""
    if unit == "tok/s":
        return f"tok/s summed over {rounds} rounds" if rounds else "tok/s"
    if unit:
        return f"{unit} over {rounds} rounds" if rounds else unit
    return ""


def _speed_parts(stats: GenerationStats) -> list[str]:
    """The cost model next to reality: what it expected of the planned rounds, what they
    achieved, and what it estimates this run and the pool at best are worth against plain
    decoding. Plain decoding was not timed here, so those are labelled estimates (a measured
    speedup is bench's), and none is shown for a run that only decoded plainly."""
    parts = []
    estimated, modelled = stats.estimated_tokens_per_s, stats.modelled_tokens_per_s
    if estimated is not None and modelled is not None:
        parts.append(f"rounds {modelled:.1f} tok/s (est. {estimated:.1f})")
    achieved, ideal = stats.achieved_speedup, stats.ideal_speedup
    speculated = any(u.drafted for u in stats.usage.values())
    if achieved is not None and ideal is not None and speculated:
        parts.append(f"est. [bold]{achieved:.2f}x[/] plain's speed (at best {ideal:.2f}x; plain not timed)")
    return parts


class LiveView:
    """Context manager around Rich Live; `update` redraws with fresh stats."""

    def __init__(self, console: Console, policy: str, show_text: bool, compact: bool = False):
        self.console = console
        self.policy = policy
        self.show_text = show_text
        self.compact = compact  # one status line (the chat's) instead of the panel
        self.text = ""
        self.live = Live(console=console, redirect_stdout=False, redirect_stderr=False,
                         transient=show_text, refresh_per_second=8, auto_refresh=True)

    def __enter__(self) -> "LiveView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.show_text:
            # Live draws its last frame in full before a transient display is erased; a frame
            # taller than the terminal would scroll off and stay. An empty last frame erases
            # cleanly, and the caller prints the text once.
            self.live.update(Text(""))
        self.live.__exit__(*exc)

    def update(self, stats: GenerationStats, delta: str = "", scores: dict[str, float] | None = None) -> None:
        if self.compact:
            line = compact_line(stats)
            if self.show_text:
                self.text += delta
                self.live.update(Group(self._tail(max(1, self.console.size.height - 3)), line))
            else:
                self.live.update(line)
            return
        panel = stats_panel(stats, self.policy, scores)
        # Two columns short of the terminal: the tty echoes "^C" after the last frame, and on
        # a full-width bottom border that echo wraps, leaving the frame's top row on screen.
        panel.width = max(20, self.console.width - 2)
        if self.show_text:
            self.text += delta
            # The frame must fit the terminal: Live crops a taller one with a full-width "..."
            # row, which the "^C" echo would wrap just the same.
            panel_rows = len(self.console.render_lines(panel, self.console.options.update(width=panel.width)))
            rows = self.console.size.height - panel_rows - 1
            self.live.update(Group(self._tail(rows), panel) if rows > 0 else panel)
        else:
            self.live.update(panel)

    def _tail(self, rows: int) -> Text:
        """The last `rows` screen rows of the text (a long line wraps into several rows)."""
        width = max(1, self.console.width)
        lines = [line[-rows * width:] for line in self.text.splitlines()[-rows:]]
        wrapped = Text("\n".join(lines)).wrap(self.console, width)
        return Text("\n").join(list(wrapped)[-rows:])


def compact_line(stats: GenerationStats) -> Text:
    """The panel in one dim line: the drafter in use, its last accepted length, the mean
    accepted tokens a round, the speed and the count."""
    drafter = escape(stats.last_drafter or "-")
    line = Text.from_markup(f"[dim]{drafter} · accepted {stats.last_accepted}/{stats.last_drafted} · mean "
                            f"{stats.tokens_per_round:.2f} a round · {stats.tokens_per_s:.1f} tok/s · "
                            f"{stats.tokens} tokens[/]", overflow="ellipsis")
    line.no_wrap = True  # one row, however narrow the terminal
    return line


def summary_line(stats: GenerationStats) -> str:
    from specdraft.models.kernels.native import kernels_in_use

    isa = kernels_in_use()  # which of specdraft's CPU kernels ran (scalar, avx2, vnni), if any did
    parts: Sequence[str] = (
        f"{stats.tokens} tokens in {stats.elapsed_s:.2f}s ({stats.tokens_per_s:.1f} tok/s)",
        f"{stats.rounds} rounds, mean accepted {stats.tokens_per_round:.2f}",
        f"trees in {stats.tree_share:.0%} of rounds" if stats.tree_rounds else "",
        " · ".join(Text.from_markup(p).plain for p in _speed_parts(stats)),
        ", ".join(f"{n} {u.rounds}r/{u.accepted}acc" for n, u in stats.usage.items() if u.rounds),
        f"kernels {isa}" if isa else "",
    )
    return " · ".join(p for p in parts if p)
