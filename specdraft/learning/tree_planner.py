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

Then runner-up leaves (EAGLE-2's top-k at a position): a drafter that ranks tokens (model
and head drafters) can give, at each drafted position, the tokens it ranks after the
drafted one, and every round in which its draft was wrong somewhere says where the
committed token came in that order at the first wrong position (`observe_runner_ups`; free
evidence: no leaf need have been verified). With h_i(w) the share of its last
`RUNNER_UP_WINDOW` verdicts within the first w runner-ups, w leaves at each of a chain's
first n positions add n * w rows and, on a remembered round where the chain's run r_i ends
before n and no chain got further, h_i(w) of a token (several such chains: 1 - prod(1 - h)).
Per chain of the tree, the (n, w) with the best rate is kept if it raises the rate by `GAIN`.

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
Leaves = tuple[tuple[int, int, int], ...]  # (arm, n, width): `width` runner-ups at each of its first n positions
Path = tuple[float, float, float]  # a tree on a remembered round: (longest accepted chain, rows off it, leaf gain)


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
    RUNNER_UP_WINDOW = 64  # runner-up verdicts remembered per drafter
    MAX_LEAVES = 8  # positions of a chain tried for leaves ...
    MAX_WIDTH = 3  # ... and runner-ups at each (the drafted token and these: its top 4)

    def __init__(self, arms: Sequence[str], plain_arms: Sequence[bool], costs: RoundCostModel,
                 runner_ups: bool = True):
        self.arms = list(arms)
        self.runner_ups = runner_ups  # plan runner-up leaves too ([policy] runner_ups)
        self.plain = list(plain_arms)
        self.costs = costs
        self.runs: deque[tuple[float | None, ...]] = deque(maxlen=self.WINDOW)
        # Per arm, where the committed token came in its order at its first wrong position,
        # for its last drafts that were wrong (1: its runner-up; past MAX_WIDTH: no leaf's).
        self.runner_up_seen: list[deque[int]] = [deque(maxlen=self.RUNNER_UP_WINDOW) for _ in self.arms]
        self._plans: dict[tuple, tuple[Branches, Leaves, float, float] | None] = {}
        self._age = 0
        self._replan = self.REPLAN

    def observe(self, gammas: Sequence[Sequence[float] | None], silent: Sequence[bool] | None) -> None:
        """An evaluated round: every arm's gammas along the committed tokens (None: not
        scored), `silent` the arms asleep at its start."""
        # An arm asleep there counts as unknown, not as a run of 0: a tree is planned among
        # awake drafters, so it is judged on the rounds where all of its drafters were awake.
        self.runs.append(tuple(None if g is None or (silent and silent[arm]) else run_length(g)
                               for arm, g in enumerate(gammas)))

    def observe_runner_ups(self, ranks: Sequence[tuple[int, int]]) -> None:
        """A round's runner-up verdicts (`RoundFeedback.runner_ups`): per drafter that was
        wrong inside its draft, where the committed token came in its order there."""
        for arm, rank in ranks:
            self.runner_up_seen[arm].append(min(rank, self.MAX_WIDTH + 1))

    def runner_up_rate(self, arm: int, width: int = 1) -> float | None:
        """How often one of `arm`'s first `width` runner-ups is right where its draft is
        first wrong (None before MIN_ROUNDS verdicts)."""
        seen = self.runner_up_seen[arm]
        return sum(rank <= width for rank in seen) / len(seen) if len(seen) >= self.MIN_ROUNDS else None

    def reset(self) -> None:
        """A prompt the policy resets at: what the window says still describes the drafters,
        but cached plans may not."""
        self._plans.clear()

    def branches(self, arm: int, k: int, cap: int, awake: Sequence[bool] | None
                 ) -> tuple[Branches, Leaves, float, float] | None:
        """The further chains for a round whose chosen `arm` drafts `k` tokens (each branch
        at most `cap` deep), among the `awake` drafters, and the runner-up leaves of the
        tree's chains: (branches, leaves, expected committed tokens, seconds) of the tree,
        or None when neither a branch nor a leaf pays."""
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

    def _plan(self, arm: int, k: int, cap: int, awake: Sequence[bool] | None
              ) -> tuple[Branches, Leaves, float, float] | None:
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
        leaves, rate = self._leaves(tree, bool(added), verify)
        if not (added or leaves) or rate is None:
            return None
        return added, leaves, rate[1], rate[2]

    def _leaves(self, tree: Branches, branched: bool, verify: dict[int, float | None]
                ) -> tuple[Leaves, tuple[float, float, float] | None]:
        """The runner-up leaves that pay on `tree` (per chain, in order, how many of its first
        positions get leaves and how many each, the best pair if it raises the estimated
        rate by GAIN), and the rate of the tree with them."""
        judged = self._judged({a for a, _ in tree})
        paths = [self._path(tree, runs) for runs in judged]
        best = self._rate(tree, paths, branched, verify)
        leaves: Leaves = ()
        if best is None or not self.runner_ups:
            return leaves, best
        depth = dict(tree)
        # h(a, w), worked out once per plan rather than once per remembered round and trial
        rates = {(a, w): self.runner_up_rate(a, w) for a in depth for w in range(1, self.MAX_WIDTH + 1)}
        for a, d in tree:
            if rates[a, 1] is None:
                continue
            pick = None
            for n in range(1, min(d, self.MAX_LEAVES) + 1):
                for width in range(1, self.MAX_WIDTH + 1):
                    trial = (*leaves, (a, n, width))
                    rate = self._rate(tree, [self._with_leaves(path, runs, depth, trial, rates)
                                             for path, runs in zip(paths, judged)], True, verify)
                    if rate is not None and rate[0] > best[0] * self.GAIN and (pick is None or rate[0] > pick[0][0]):
                        pick = (rate, (a, n, width))
            if pick is not None:
                best, leaves = pick[0], (*leaves, pick[1])
        return leaves, best

    @staticmethod
    def _with_leaves(path: Path, runs: tuple[float | None, ...], depth: dict[int, int], leaves: Leaves,
                     rates: dict[tuple[int, int], float | None]) -> Path:
        """`path` with runner-up leaves on the tree's chains (`depth`: arm -> its chain's
        depth): each adds its row; where a chain's run ends inside its leaves and no chain
        got further, its leaves there add a token as often as one of them is right (`rates`:
        `runner_up_rate` by arm and width)."""
        longest, wrong, gain = path
        missed, rows = 1.0, 0
        for a, n, width in leaves:
            n = min(n, depth[a])
            rows += n * width
            run = int(runs[a])
            if run < n and run == int(longest):
                missed *= 1.0 - rates[a, width]
        return longest, wrong + rows, gain + 1.0 - missed

    def _judged(self, arms: set[int]) -> list[tuple[float | None, ...]]:
        """The remembered rounds in which every one of `arms` was scored and awake."""
        return [runs for runs in self.runs if all(runs[i] is not None for i in arms)]

    @classmethod
    def _path(cls, tree: Branches, runs: tuple[float | None, ...]) -> Path:
        """`tree` replayed on a remembered round: (the longest accepted chain, the drafted
        tokens off it, 0: no leaves)."""
        path = (0.0, 0.0, 0.0)
        for i, d in tree:
            path = cls._extend(path, runs[i], d)
        return path

    @staticmethod
    def _extend(path: Path, run: float, depth: int) -> Path:
        """`path` (`_path` of a tree on a round) with one more chain, `depth` deep, of a
        drafter whose run of accepted tokens on that round was `run`."""
        longest, wrong, gain = path
        hit = run if run < depth else depth
        return (longest if longest >= hit else hit), wrong + depth - hit, gain

    def _rate(self, tree: Branches, paths: Sequence[Path], branched: bool,
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
        for longest, wrong, gain in paths:
            tokens += 1.0 + longest + gain
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
