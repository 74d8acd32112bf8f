"""Planning a token tree (ARCHITECTURE.md, "Trees"): which further drafters a round adds to
the chosen drafter's chain, and how deep, for the best estimated tokens per second.

The evidence is full information: every evaluated round scores every drafter at every
committed position, so each drafter's *run* there, had it drafted from the round's start,
is known: its leading accepted positions (greedy: the leading 1s of its gammas; sampling:
the expected run, the sum of the running products). The planner keeps the runs of the last
`WINDOW` evaluated rounds (an arm not scored there, or asleep, unknown: a tree is judged on
the rounds in which all of its drafters were awake, as they are when it is planned).

A tree of chains {(arm i, depth d_i)} replayed on a remembered round commits
1 + max_i min(r_i, d_i) tokens (the target follows the longest accepted chain; exact under
greedy), and verifies 1 + max_i min(r_i, d_i) + sum_i (d_i - min(r_i, d_i)) rows: the chains
agree along the committed path (merged there) and are taken to part everywhere else, so
merges of wrong tokens only make a tree cheaper than planned. Its rate over the window is
sum(committed) / sum(T), T = c_verify(rows) + sum_i d_i c_draft(i) from the round cost
model, plus what a tree round costs beyond its forward's width (merging, the host reads
of its walk: `RoundCostModel.tree_extra`, learned from the tree rounds). Starting from the
chosen chain, a branch (another awake drafter at some depth) is added while the best one
raises that rate by `GAIN` over the tree without it, both judged on the same remembered
rounds (those where every drafter of the larger tree was scored and awake, at least
`MIN_ROUNDS` of them); at most `MAX_BRANCHES`. Chains that
copy the same context (two lookups) agree most of the time, so their union adds little:
the window measures how much, instead of assuming independence.

Runs are cut at what the round committed (the positions after it were not scored), so
deep chains are judged conservatively. Plans are cached per (chosen arm, its K, the cap,
awake drafters) and the cache is emptied every `REPLAN` rounds, since replanning costs
a fraction of a millisecond of Python; while no cached plan found a branch, the wait doubles
up to `MAX_REPLAN` rounds (a new prompt empties the cache all the same). Plain Python: no torch.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from specdraft.learning.goodput import RoundCostModel

Branches = tuple[tuple[int, int], ...]  # (arm, depth) of each further chain


def run_length(gammas: Sequence[float]) -> float:
    """A drafter's run from a round's start given its gammas along the committed tokens:
    its expected accepted positions, the sum of the running products (under greedy the
    gammas are 0 or 1: the leading accepted positions)."""
    total, survive = 0.0, 1.0
    for gamma in gammas:
        survive *= gamma
        total += survive
    return total


class TreePlanner:
    WINDOW = 48  # evaluated rounds remembered
    GAIN = 1.03  # a branch must raise the estimated tokens/s by this factor (merging costs host time)
    MAX_BRANCHES = 3
    REPLAN = 8  # rounds a plan is reused for the same chosen arm, K and awake drafters ...
    MAX_REPLAN = 64  # ... doubling up to this while no plan found a branch that pays
    MIN_ROUNDS = 8  # evaluated rounds before any branch is planned
    DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # depths tried for a branch (up to the cap)

    def __init__(self, arms: Sequence[str], plain_arms: Sequence[bool], costs: RoundCostModel):
        self.arms = list(arms)
        self.plain = list(plain_arms)
        self.costs = costs
        self.runs: deque[tuple[float | None, ...]] = deque(maxlen=self.WINDOW)
        self._plans: dict[tuple, tuple[Branches, float, float] | None] = {}
        self._age = 0
        self._replan = self.REPLAN

    def observe(self, gammas: Sequence[Sequence[float] | None], silent: Sequence[bool] | None) -> None:
        """An evaluated round: every arm's gammas along the committed tokens (None: not
        scored), `silent` the arms asleep at its start."""
        # An arm asleep there counts as unknown, not as a run of 0: a tree is planned among
        # awake drafters, so it is judged on the rounds where all of its drafters were awake.
        self.runs.append(tuple(None if g is None or (silent and silent[arm]) else run_length(g)
                               for arm, g in enumerate(gammas)))

    def reset(self) -> None:
        """A prompt the policy resets at: what the window says still describes the drafters,
        but cached plans may not."""
        self._plans.clear()

    def branches(self, arm: int, k: int, cap: int, awake: Sequence[bool] | None
                 ) -> tuple[Branches, float, float] | None:
        """The further chains for a round whose chosen `arm` drafts `k` tokens (each branch
        at most `cap` deep), among the `awake` drafters: (branches, expected committed
        tokens, seconds) of the tree, or None when no branch pays."""
        self._age += 1
        if self._age >= self._replan:
            # Where trees do not pay (a CPU whose verify rows are dear, drafters that agree),
            # replanning finds nothing again and again at a few tenths of a millisecond each:
            # wait longer each time it finds nothing. A new prompt still plans afresh (reset).
            paid = any(plan is not None for plan in self._plans.values())
            self._replan = self.REPLAN if paid else min(2 * self._replan, self.MAX_REPLAN)
            self._plans.clear()
            self._age = 0
        key = (arm, k, cap, None if awake is None else tuple(awake))
        if key not in self._plans:
            self._plans[key] = self._plan(arm, k, cap, awake)
            if self._plans[key] is not None:  # trees pay again: renew plans at the usual pace
                self._replan = self.REPLAN
        return self._plans[key]

    def _plan(self, arm: int, k: int, cap: int, awake: Sequence[bool] | None) -> tuple[Branches, float, float] | None:
        if len(self.runs) < self.MIN_ROUNDS or cap == 0:
            return None
        tree: Branches = ((arm, k),) if k > 0 and not self.plain[arm] else ()
        candidates = [i for i in range(len(self.arms))
                      if i != arm and not self.plain[i] and (awake is None or awake[i])
                      and self.costs.draft[i] is not None]
        depths = [d for d in self.DEPTHS if d <= cap] or [cap]
        verify: dict[int, float | None] = {}  # the verify cost by width, looked up once per plan
        added: Branches = ()
        for _ in range(self.MAX_BRANCHES):
            pick = None  # (gain, branch)
            for i in candidates:
                if any(i == a for a, _ in tree):
                    continue
                # Judged on the remembered rounds where the tree's drafters and i were scored.
                judged = self._judged({a for a, _ in tree} | {i})
                paths = [self._path(tree, runs) for runs in judged]
                base = self._rate(tree, paths, bool(added), verify)
                if base is None:
                    continue
                for d in depths:
                    branched = [self._extend(path, runs[i], d) for path, runs in zip(paths, judged)]
                    rate = self._rate((*tree, (i, d)), branched, True, verify)
                    if rate is not None and rate[0] > base[0] * self.GAIN and (pick is None or rate[0] / base[0] > pick[0]):
                        pick = (rate[0] / base[0], (i, d))
            if pick is None:
                break
            tree, added = (*tree, pick[1]), (*added, pick[1])
        if not added:
            return None
        rate = self._rate(tree, [self._path(tree, runs) for runs in self._judged({a for a, _ in tree})], True, verify)
        return (added, rate[1], rate[2]) if rate is not None else None

    def _judged(self, arms: set[int]) -> list[tuple[float | None, ...]]:
        """The remembered rounds in which every one of `arms` was scored and awake."""
        return [runs for runs in self.runs if all(runs[i] is not None for i in arms)]

    @classmethod
    def _path(cls, tree: Branches, runs: tuple[float | None, ...]) -> tuple[float, float]:
        """`tree` replayed on a remembered round: (the longest accepted chain, the drafted
        tokens off it)."""
        path = (0.0, 0.0)
        for i, d in tree:
            path = cls._extend(path, runs[i], d)
        return path

    @staticmethod
    def _extend(path: tuple[float, float], run: float, depth: int) -> tuple[float, float]:
        """`path` (`_path` of a tree on a round) with one more chain, `depth` deep, of a
        drafter whose run of accepted tokens on that round was `run`."""
        longest, wrong = path
        hit = run if run < depth else depth
        return (longest if longest >= hit else hit), wrong + depth - hit

    def _rate(self, tree: Branches, paths: Sequence[tuple[float, float]], branched: bool,
              verify: dict[int, float | None]) -> tuple[float, float, float] | None:
        """(tokens per second, mean committed, mean seconds) of `tree` over remembered
        rounds it replays on as `paths` (`_path` of each; `branched`: a tree round's own
        costs are added); None with fewer than MIN_ROUNDS of them or while costs are
        unknown. `verify` memoises the verify cost by width."""
        if len(paths) < self.MIN_ROUNDS:
            return None
        draft = sum(d * (self.costs.draft[i] or 0.0) for i, d in tree)
        if branched:
            draft += self.costs.tree_extra
        tokens = 0.0
        widths: dict[int, int] = {}
        for longest, wrong in paths:
            tokens += 1.0 + longest
            width = 1 + int(round(longest + wrong))
            widths[width] = widths.get(width, 0) + 1
        seconds = len(paths) * draft
        for width, count in widths.items():
            if width not in verify:
                verify[width] = self.costs.verify(width)
            cost = verify[width]
            if cost is None:
                return None
            seconds += count * cost
        if seconds <= 0:
            return None
        return tokens / seconds, tokens / len(paths), seconds / len(paths)
