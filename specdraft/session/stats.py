"""Per-generation statistics from round records; plain Python, shared by the CLI, the
panel and the benchmarks, so every number means the same thing everywhere."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specdraft.learning.feedback import RegretTracker


@dataclass
class DrafterUsage:
    rounds: int = 0  # rounds the policy chose it
    drafted: int = 0  # tokens it drafted, as the chosen chain or a tree's branch
    accepted: int = 0  # of those, the ones committed
    branched: int = 0  # tree rounds it drafted a chain in (beside another drafter's)
    won: int = 0  # tree rounds whose committed tokens followed its chain furthest
    runner_ups: int = 0  # runner-up leaves of its chains verified
    runner_up_won: int = 0  # rounds whose committed tokens ended on one of them

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class GenerationStats:
    """Running totals; `add` one round at a time so a live view can read them mid-stream."""

    drafter_names: list[str]
    draft_tokens: int = 5  # K, the cap on each drafter's expected accepted length
    tokens: int = 0
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    elapsed_s: float = 0.0
    last_drafter: str | None = None
    last_accepted: int = 0
    last_drafted: int = 0
    last_planned: int = 0
    evaluate_s: float = 0.0
    prefill_s: float = 0.0  # the prompts' prefill: the target's, and the drafters' scored from the start
    prefill_tokens: int = 0  # prompt tokens the target prefilled (a prefix its cache held is not)
    # drafted tokens per round (a tree's size: shared prefixes once) -> rounds
    draft_lengths: Counter = field(default_factory=Counter)
    tree_rounds: int = 0  # rounds that verified more than one drafter's chain
    branches: int = 0  # chains verified, summed over rounds
    last_tree_size: int = 0
    last_branches: int = 1
    last_winner: str | None = None
    runner_up_rounds: int = 0  # rounds that verified runner-up leaves beside the chains
    runner_up_leaves: int = 0  # those leaves, summed over rounds
    runner_up_wins: int = 0  # rounds whose committed tokens ended on one
    last_runner_ups: int = 0
    # The policy's estimates for the rounds it could estimate, so a user can see how well
    # the cost model predicts this machine: expected committed tokens and seconds.
    expected_tokens: float = 0.0
    expected_seconds: float = 0.0
    estimated_rounds_s: float = 0.0  # measured draft + verify seconds of those same rounds
    estimated_rounds_tokens: int = 0
    plain_step_s: float | None = None  # the cost model's plain decoding step, c_verify(1)
    ideal_speedup: float | None = None  # G(best arm, best K) * c_verify(1), from the round planner
    usage: dict[str, DrafterUsage] = field(default_factory=dict)
    regret_tracker: RegretTracker | None = None  # only with full-information evaluation

    def __post_init__(self) -> None:
        self.usage = {name: DrafterUsage() for name in self.drafter_names}

    def add(self, record) -> None:
        self.tokens += len(record.tokens)
        self.rounds += 1
        self.draft_s += record.times.draft_s
        self.verify_s += record.times.verify_s
        self.overhead_s += record.times.overhead_s
        self.evaluate_s += record.times.evaluate_s
        self.prefill_s += record.times.prefill_s
        self.prefill_tokens += record.times.prefill_tokens
        values = record.learning.values  # valued by the policy, in the objective it optimises
        for j, (arm, gammas) in enumerate(record.learning.evaluated or ()):
            if self.regret_tracker is None:
                unit = record.learning.value_unit if values is not None else "tokens"
                self.regret_tracker = RegretTracker(list(self.drafter_names), unit)
            if values is not None:
                self.regret_tracker.add(arm, values[j])
            else:
                self.regret_tracker.add_round(arm, gammas, self.draft_tokens)
        # (a tree round: accepted of the tree's drafted tokens)
        self.last_drafter, self.last_accepted = record.drafter, record.accepted
        leaves = sum(n for _, n in record.tree.runner_ups)
        self.last_drafted = record.tree.tree_size if record.tree.branches and (len(record.tree.branches) > 1 or leaves) \
            else record.drafted
        self.last_planned = record.learning.planned
        branches = record.tree.branches or [(record.drafter, record.drafted, record.accepted)]
        tree_size = record.tree.tree_size if record.tree.branches else record.drafted
        self.last_tree_size, self.last_branches, self.last_winner = tree_size, len(branches), record.tree.winner
        self.draft_lengths[tree_size] += 1
        self.branches += len(branches)
        if len(branches) > 1:
            self.tree_rounds += 1
        self._add_runner_ups(record, leaves)
        if record.learning.expected_seconds:
            self.expected_tokens += record.learning.expected_tokens
            self.expected_seconds += record.learning.expected_seconds
            self.estimated_rounds_s += record.times.draft_s + record.times.verify_s
            self.estimated_rounds_tokens += record.accepted + 1
        self.usage.setdefault(record.drafter, DrafterUsage()).rounds += 1
        for name, drafted, kept in branches:
            use = self.usage.setdefault(name, DrafterUsage())
            use.drafted += drafted
            use.accepted += kept
            if len(branches) > 1:
                use.branched += 1
                use.won += name == record.tree.winner

    def _add_runner_ups(self, record, leaves: int) -> None:
        """A round's runner-up leaves (`leaves` in all) and whether it ended on one."""
        self.last_runner_ups = leaves
        if leaves:
            self.runner_up_rounds += 1
            self.runner_up_leaves += leaves
            self.runner_up_wins += record.tree.runner_up_won is not None
        for name, n in record.tree.runner_ups:
            self.usage.setdefault(name, DrafterUsage()).runner_ups += n
        if record.tree.runner_up_won is not None:
            self.usage.setdefault(record.tree.runner_up_won, DrafterUsage()).runner_up_won += 1

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per round (per target verify forward), the bonus token included
        (plain decoding: 1): mean accepted tokens (MAT), `mean_accepted` in --json. A round's
        own `accepted` counts accepted draft tokens only."""
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def tree_share(self) -> float:
        """The share of rounds that verified a tree of several drafters' chains."""
        return self.tree_rounds / self.rounds if self.rounds else 0.0

    @property
    def branches_per_round(self) -> float:
        """Drafters' chains verified per round (1: every round one chain)."""
        return self.branches / self.rounds if self.rounds else 0.0

    @property
    def _tracked(self) -> RegretTracker | None:
        """The regret tracker once it holds a valued round."""
        return self.regret_tracker if self.regret_tracker and self.regret_tracker.rounds else None

    @property
    def regret(self) -> float | None:
        """Cumulative regret against the best fixed drafter in hindsight, in `regret_unit`
        (the policy's objective: expected accepted tokens, or tokens per second summed over
        the evaluated rounds); None when only the chosen drafter was scored (it cannot be
        known) or before a round could be valued. See RegretTracker: a drafter is ranked
        only on what it earned in the rounds it was scored in."""
        return self._tracked.regret if self._tracked else None

    @property
    def regret_unit(self) -> str | None:
        """The regret's unit: "tokens" (objective = "acceptance") or "tok/s" (goodput)."""
        return self._tracked.unit if self._tracked else None

    @property
    def regret_rounds(self) -> int | None:
        """The evaluated rounds the regret is summed over."""
        return self._tracked.rounds if self._tracked else None

    @property
    def best_drafter(self) -> str | None:
        """The best fixed drafter in hindsight, in `regret_unit`."""
        return self.drafter_names[self._tracked.best] if self._tracked else None

    @property
    def best_arm_share(self) -> float | None:
        return self._tracked.best_arm_share if self._tracked else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def learn_estimates(self, planner) -> None:
        """Read the round planner's current view of this machine: plain step cost and ideal speedup."""
        self.plain_step_s = planner.costs.round_seconds(0, 0)
        best = planner.ideal_speedup()
        self.ideal_speedup = best[2] if best else None

    @property
    def estimated_tokens_per_s(self) -> float | None:
        """What the cost model expected of the rounds it planned: sum E / sum T."""
        return self.expected_tokens / self.expected_seconds if self.expected_seconds > 0 else None

    @property
    def modelled_tokens_per_s(self) -> float | None:
        """What those same rounds achieved in draft + verify time (the part the model predicts)."""
        if self.estimated_rounds_s <= 0:
            return None
        return self.estimated_rounds_tokens / self.estimated_rounds_s

    @property
    def achieved_speedup(self) -> float | None:
        """Measured tokens/s (wall time, everything included) over the cost model's plain
        decoding rate 1 / c_verify(1)."""
        if not self.plain_step_s or self.elapsed_s <= 0:
            return None
        return self.tokens_per_s * self.plain_step_s

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "mean_accepted": round(self.tokens_per_round, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_tokens": self.prefill_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "drafters": {n: {"rounds": u.rounds, "accepted": u.accepted, "drafted": u.drafted,
                             "branched": u.branched, "won": u.won, "runner_ups": u.runner_ups,
                             "runner_up_won": u.runner_up_won} for n, u in self.usage.items()},
            "tree_rounds": self.tree_rounds,
            "runner_up_rounds": self.runner_up_rounds,
            "runner_up_leaves": self.runner_up_leaves,
            "runner_up_wins": self.runner_up_wins,
            "branches_per_round": round(self.branches_per_round, 4),
            "time_s": {"draft": round(self.draft_s, 4), "verify": round(self.verify_s, 4),
                       "evaluate": round(self.evaluate_s, 4), "prefill": round(self.prefill_s, 4),
                       "overhead": round(self.overhead_s, 4)},
            "draft_lengths": {str(k): n for k, n in sorted(self.draft_lengths.items())},
            "estimated_tokens_per_s": _round(self.estimated_tokens_per_s, 3),
            "modelled_rounds_tokens_per_s": _round(self.modelled_tokens_per_s, 3),
            # against the cost model's plain step, not a timed plain run: estimates, named so
            "estimated_speedup": _round(self.achieved_speedup, 3),
            "estimated_ideal_speedup": _round(self.ideal_speedup, 3),
            "regret": None if self.regret is None else round(self.regret, 4),
            "regret_unit": self.regret_unit,
            "regret_rounds": self.regret_rounds,
            "best_drafter": self.best_drafter,
            "best_arm_share": None if self.best_arm_share is None else round(self.best_arm_share, 4),
        }



def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
