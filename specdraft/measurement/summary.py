"""What bench prints and writes: per task and configuration (and "all" tasks), the speedup
over plain decoding, mean accepted tokens, acceptance by position, regret, mismatches, the
time split, the drafted lengths (a tree's size) and how often rounds verified trees and
whose branch won, with marks on numbers that should not be trusted. Also
the two views of a stream: leaving its first prompts out (they warm drafters that learn
from earlier answers) and speed as a ratio to a chosen configuration."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Sequence

from specdraft.measurement.benchmark import PLAIN, Sample

NOISY_SPREAD = 1.5  # slowest / fastest repeat of one prompt beyond this: the timing is noise-dominated
PLAUSIBLE_MARGIN = 1.2  # a speedup above mean accepted x this cannot come from fewer target forwards


@dataclass
class SummaryRow:
    """One row of the summary: a configuration over a task's prompts (or "all" of them).
    `as_dict` is the row bench prints, writes to JSON and CSV, and plots: these fields, in
    this order."""

    task: str
    config: str
    prompts: int
    speedup: float | None  # plain decoding's wall time over this configuration's
    mean_accepted: float | None  # committed tokens per round, the bonus token included
    acceptance_at: list[float | None]  # accepted / drafted at each draft position
    tokens_per_s: float
    best_arm_share: float | None
    regret: float | None
    regret_unit: str | None  # one policy per config, so one unit ("mixed" only if samples disagree)
    mismatches: int | None  # greedy outputs that differ from plain decoding's (None: a peer engine)
    identical: float | None  # a peer engine's share of outputs with plain decoding's text
    failed: int
    time_share: dict[str, float]  # phase -> share of the wall time
    draft_lengths: dict[str, int]  # drafted length (a tree's size) -> rounds
    tree_share: float | None  # rounds that verified several drafters' chains (None: plain or a peer)
    branches_per_round: float | None  # chains verified per round
    wins: dict[str, float]  # drafter -> share of the tree rounds its branch won
    runner_up_share: float | None  # rounds that verified runner-up leaves (None: plain or a peer)
    runner_up_wins: float | None  # of those, the share whose committed tokens ended on a leaf
    ideal_speedup: float | None
    repeat_spread: float | None  # slowest / fastest repeat of one prompt, the largest
    noisy: bool
    implausible: bool

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples: Sequence[Sample]) -> list[dict]:
    """Per task and configuration, plus an "all" row per configuration (SummaryRow.as_dict).

    Two checks mark a number that should not be trusted. `repeat_spread`: the largest ratio
    of slowest to fastest repeat of one prompt (None with one repeat); above NOISY_SPREAD
    the row is `noisy`. `implausible`: the speedup exceeds mean accepted tokens x
    PLAUSIBLE_MARGIN, yet a round of K + 1 positions costs at least a plain step, so
    speculation saves at most a factor of mean accepted (plain decoding's own noise makes
    every speedup wrong that way)."""
    groups = _groups(samples)
    plain_time = {task: sum(s.elapsed_s for s in group) for (task, config), group in groups.items()
                  if config == PLAIN}
    order = list(dict.fromkeys(s.config for s in samples))
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0][0], order.index(kv[0][1])))
    return [_row(task, config, group, plain_time.get(task, 0.0)).as_dict() for (task, config), group in ordered]


def _groups(samples: Sequence[Sample]) -> dict[tuple[str, str], list[Sample]]:
    """(task, config) -> its samples, and ("all", config) -> every sample of the config."""
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[(s.task, s.config)].append(s)
        groups[("all", s.config)].append(s)
    return groups


def _row(task: str, config: str, group: list[Sample], plain_time: float) -> SummaryRow:
    elapsed = sum(s.elapsed_s for s in group)
    tokens = sum(s.tokens for s in group)
    rounds = sum(s.rounds for s in group)
    split, lengths = _time_split(group), _draft_lengths(group)
    peer = group[0].peer
    speedup = plain_time / elapsed if elapsed else None
    mean_accepted = tokens / rounds if rounds else None
    spread = _repeat_spread(group)
    return SummaryRow(
        task=task, config=config, prompts=len({(s.id, s.repeat) for s in group}), speedup=speedup,
        mean_accepted=mean_accepted, acceptance_at=_acceptance_at(group),
        tokens_per_s=tokens / elapsed if elapsed else 0.0,
        best_arm_share=_mean([s.best_arm_share for s in group]), regret=_mean([s.regret for s in group]),
        regret_unit=_regret_unit(group), mismatches=None if peer else sum(s.mismatch for s in group),
        identical=sum(bool(s.identical) for s in group) / len(group) if peer else None,
        failed=sum(s.failed is not None for s in group),
        time_share={phase: seconds / elapsed for phase, seconds in split.items()} if elapsed else {},
        draft_lengths=dict(sorted(lengths.items(), key=lambda kv: int(kv[0]))),
        tree_share=sum(s.tree_rounds for s in group) / rounds if rounds and not peer and config != PLAIN else None,
        branches_per_round=sum(s.branches for s in group) / rounds if rounds and not peer and config != PLAIN else None,
        wins=_wins(group),
        runner_up_share=sum(s.runner_up_rounds for s in group) / rounds if rounds and not peer and config != PLAIN
        else None,
        runner_up_wins=_share(sum(s.runner_up_wins for s in group), sum(s.runner_up_rounds for s in group)),
        ideal_speedup=_mean([s.ideal_speedup for s in group]),
        repeat_spread=spread, noisy=spread is not None and spread > NOISY_SPREAD,
        implausible=(speedup is not None and mean_accepted is not None and rounds > 0
                     and speedup > mean_accepted * PLAUSIBLE_MARGIN))


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values that are not None; None when there is none."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _acceptance_at(group: list[Sample]) -> list[float | None]:
    k = max((len(s.drafted_at) for s in group), default=0)
    drafted = [sum(s.drafted_at[j] for s in group if j < len(s.drafted_at)) for j in range(k)]
    accepted = [sum(s.accepted_at[j] for s in group if j < len(s.accepted_at)) for j in range(k)]
    return [a / d if d else None for a, d in zip(accepted, drafted)]


def _regret_unit(group: list[Sample]) -> str | None:
    units = {s.regret_unit for s in group if s.regret is not None}
    return (units.pop() if len(units) == 1 else "mixed") if units else None


def _added_up(mappings) -> dict:
    """Key by key sums of the samples' mappings (phase -> seconds, drafted length -> rounds)."""
    total: dict = defaultdict(int)
    for mapping in mappings:
        for key, value in mapping.items():
            total[key] += value
    return total


def _time_split(group: list[Sample]) -> dict[str, float]:
    return _added_up(s.time_s for s in group)


def _wins(group: list[Sample]) -> dict[str, float]:
    """Per drafter, the share of the group's tree rounds whose committed tokens followed its branch."""
    trees = sum(s.tree_rounds for s in group)
    won = _added_up(s.won for s in group)
    return {name: count / trees for name, count in sorted(won.items(), key=lambda kv: -kv[1])} if trees else {}


def _draft_lengths(group: list[Sample]) -> dict[str, int]:
    return _added_up(s.draft_lengths for s in group)


def _repeat_spread(group: Sequence[Sample]) -> float | None:
    times: dict[str, list[float]] = defaultdict(list)
    for s in group:
        times[s.id].append(s.elapsed_s)
    spreads = [max(t) / min(t) for t in times.values() if len(t) > 1 and min(t) > 0]
    return round(max(spreads), 3) if spreads else None


def noise_warnings(rows: Sequence[dict]) -> list[str]:
    """One line per problem `summarize` marked, saying what it means."""
    lines = []
    noisy = [r for r in rows if r.get("noisy") and r["task"] == "all"]
    if noisy:
        worst = max(noisy, key=lambda r: r["repeat_spread"])
        lines.append(f"noisy timing: repeats of one prompt differ by up to {worst['repeat_spread']:.1f}x "
                     f"({worst['config']}; marked ?): the machine is busy or throttling, so speedups may be off by "
                     f"as much; rerun on an idle machine or with more --repeat")
    for r in rows:
        if r.get("implausible"):
            lines.append(f"implausible speedup: {r['config']} ({r['task']}) {r['speedup']:.2f}x with mean accepted "
                         f"{r['mean_accepted']:.2f} (marked ?): speculation saves at most a factor of mean accepted, "
                         f"so plain decoding's timing was disturbed")
    return lines


def after_warmup(samples: Sequence[Sample], skip: int) -> list[Sample]:
    """The samples of every prompt but the first `skip` (in the order they ran)."""
    kept = set(list(dict.fromkeys(s.id for s in samples))[skip:])
    return [s for s in samples if s.id in kept]


def add_versus(rows: Sequence[dict], config: str) -> None:
    """Set each row's `versus`: its speed over `config`'s on the same task (the ratio of the
    two speedups, i.e. of their wall times over the same prompts); None where `config` has
    no row for the task (a run interrupted before it measured that task)."""
    reference = {r["task"]: r.get("speedup") for r in rows if r["config"] == config}
    for row in rows:
        own, other = row.get("speedup"), reference.get(row["task"])
        row["versus"] = own / other if own is not None and other else None
