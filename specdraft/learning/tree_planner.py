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
model. Starting from the chosen chain, a branch (another awake drafter at some depth) is
added while the best one raises that rate by `GAIN`; at most `MAX_BRANCHES`. Chains that
copy the same context (two lookups) agree most of the time, so their union adds little:
the window measures how much, instead of assuming independence.

A plan is kept for `REPLAN` rounds per (chosen arm, its K, awake drafters), since
replanning costs milliseconds of Python. Plain Python: no torch.
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
    REPLAN = 8  # rounds a plan is reused for the same chosen arm, K and awake drafters
    MIN_ROUNDS = 8  # evaluated rounds before any branch is planned
    DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # depths tried for a branch (up to the cap)

    def __init__(self, arms: Sequence[str], plain_arms: Sequence[bool], costs: RoundCostModel):
        self.arms = list(arms)
        self.plain = list(plain_arms)
        self.costs = costs
        self.runs: deque[tuple[float | None, ...]] = deque(maxlen=self.WINDOW)
        self._plans: dict[tuple, tuple[Branches, float, float] | None] = {}
        self._age = 0

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
        if self._age >= self.REPLAN:
            self._plans.clear()
            self._age = 0
        key = (arm, k, cap, None if awake is None else tuple(awake))
        if key not in self._plans:
            self._plans[key] = self._plan(arm, k, cap, awake)
        return self._plans[key]

    def _plan(self, arm: int, k: int, cap: int, awake: Sequence[bool] | None) -> tuple[Branches, float, float] | None:
        if len(self.runs) < self.MIN_ROUNDS or cap == 0:
            return None
        chosen = ((arm, k),) if k > 0 and not self.plain[arm] else ()
        candidates = [i for i in range(len(self.arms))
                      if i != arm and not self.plain[i] and (awake is None or awake[i])
                      and self.costs.draft[i] is not None]
        if not candidates:
            return None
        best = self._rate(chosen)
        if best is None:
            return None
        tree = chosen
        added: Branches = ()
        depths = [d for d in self.DEPTHS if d <= cap] or [cap]
        for _ in range(self.MAX_BRANCHES):
            pick = None
            for i in candidates:
                if any(i == a for a, _ in tree):
                    continue
                for d in depths:
                    rate = self._rate((*tree, (i, d)))
                    if rate is not None and rate[0] > best[0] * self.GAIN and (pick is None or rate[0] > pick[0][0]):
                        pick = (rate, (i, d))
            if pick is None:
                break
            best, tree, added = pick[0], (*tree, pick[1]), (*added, pick[1])
        if not added:
            return None
        return added, best[1], best[2]

    def _rate(self, tree: Branches) -> tuple[float, float, float] | None:
        """(tokens per second, mean committed, mean seconds) of `tree` over the remembered
        rounds in which all its arms were scored; None when there are none or costs are unknown."""
        verify = self.costs.verify
        draft = sum(d * (self.costs.draft[i] or 0.0) for i, d in tree)
        tokens = seconds = 0.0
        rounds = 0
        widths: dict[int, int] = {}
        for runs in self.runs:
            longest, wrong = 0.0, 0.0
            known = True
            for i, d in tree:
                r = runs[i]
                if r is None:
                    known = False
                    break
                hit = r if r < d else d
                if hit > longest:
                    longest = hit
                wrong += d - hit
            if not known:
                continue
            rounds += 1
            tokens += 1.0 + longest
            width = 1 + int(round(longest + wrong))
            widths[width] = widths.get(width, 0) + 1
        if rounds == 0:
            return None
        for width, count in widths.items():
            cost = verify(width)
            if cost is None:
                return None
            seconds += count * cost
        seconds += rounds * draft
        if seconds <= 0:
            return None
        return tokens / seconds, tokens / rounds, seconds / rounds
