"""Alignment feedback in plain Python: what policies learn from (ARCHITECTURE.md, "Feedback").

- alpha_j = 1 - TV(p_j, q_j): the probability drafted position j would be accepted.
- BD reward (MetaSD): mean alpha over the chosen drafter's drafted positions.
- BE reward (MetaSD): accepted / drafted.
- Expected acceptance length (HedgeSpec Theorem 3), unbiased from one trajectory:
  EAL = sum_{k=1..m+1} k (1 - g_k) prod_{j<k} g_j, with g_{m+1} = 0.
- Chunk losses: 1 - EAL / (K + 1) (length) or mean(1 - g) (acceptance rate).
- Regret against the best fixed drafter in hindsight, in the unit of the objective the
  policy optimises: per-round EAL of every scored drafter, or its tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RoundFeedback:
    """What one round reveals. `alphas[j]` = 1 - TV(p_j, q_j) at the chosen drafter's drafted
    position j; `gammas[i]`, with full-information evaluation, the same quantity for every
    arm i at every committed position of the round (None under bandit feedback)."""

    arm: int
    drafted: int
    accepted: int  # drafted tokens accepted (the bonus/recovered token not counted)
    alphas: Sequence[float] = ()
    round_seconds: float = 0.0  # select + draft + verify, evaluation excluded
    gammas: Sequence[Sequence[float]] | None = None
    draft_seconds: float = 0.0  # the split the round cost model is fitted on
    verify_seconds: float = 0.0
    verify_width: int = 0  # tokens the verify forward ran over, padding included (0: drafted + 1)
    # Per arm, True when that drafter would have proposed nothing at the round's start
    # (prompt lookup without a match): asleep, it was no candidate for the round. Set when
    # the round was chosen among the awake arms, else filled in by the evaluator.
    silent: Sequence[bool] | None = None
    # A tree round's further chains, as (arm, tokens drafted, seconds drafting them): what
    # the cost model learns those drafters' draft costs from.
    branch_drafts: Sequence[tuple[int, int, float]] = ()
    # The lookup match length behind the chosen drafter's draft (0: not a lookup): what the
    # planner keys a lookup's acceptance on when it trims the next drafts of that drafter.
    match_length: int = 0
    # Per drafter of the round that ranks tokens and was wrong inside its draft: (arm, where
    # the token committed at its first wrong position came in its order: 1 = its runner-up).
    runner_ups: Sequence[tuple[int, int]] = ()

    def __post_init__(self) -> None:
        # Alignments are probabilities; a drafter (or a target) whose outputs are NaN yields
        # NaN ones, which would poison every weight and estimate learned from them (and hang
        # a Thompson draw). Such a position counts as rejected.
        if not all(0.0 <= a <= 1.0 for a in self.alphas):
            object.__setattr__(self, "alphas", _probabilities(self.alphas))
        if self.gammas is not None and not all(g is None or all(0.0 <= v <= 1.0 for v in g) for g in self.gammas):
            object.__setattr__(self, "gammas", [g if g is None else _probabilities(g) for g in self.gammas])


def _probabilities(values: Sequence[float]) -> list[float]:
    return [probability(v) for v in values]


def probability(value: float) -> float:
    """`value` as a probability: NaN as 0 (a rejection), anything else clamped into [0, 1]."""
    return min(1.0, max(0.0, value)) if value == value else 0.0


def bd_reward(alphas: Sequence[float]) -> float:
    return sum(alphas) / len(alphas) if alphas else 0.0


def be_reward(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else 0.0


def expected_accept_length(gammas: Sequence[float]) -> float:
    """Expected committed tokens of a round whose per-position acceptance probabilities are
    `gammas` (bonus token included): in [1, len(gammas) + 1]."""
    total, survive = 0.0, 1.0
    for k, g in enumerate(gammas, start=1):
        total += k * (1.0 - g) * survive
        survive *= g
    return total + (len(gammas) + 1) * survive


def length_loss(gammas: Sequence[float], draft_tokens: int) -> float:
    """HedgeSpec's chunk loss, normalised by the most a round can commit (K + 1)."""
    return 1.0 - expected_accept_length(gammas[:draft_tokens]) / (draft_tokens + 1)


def acceptance_loss(gammas: Sequence[float]) -> float:
    return sum(1.0 - g for g in gammas) / len(gammas) if gammas else 1.0


@dataclass
class RegretTracker:
    """Regret against the best fixed drafter in hindsight, in the unit of the objective the
    policy optimises (`unit`; values from `learning/policies/objective.py`): "tokens" under
    `objective = "acceptance"`, where a drafter's value on a round is its expected accepted
    length (EAL, bonus token included, over the first K gammas); "tok/s" under the goodput
    objective, where it is the round's expected committed tokens over the round's seconds
    by the policy's own cost model. A drafter that accepts more but costs far more is not
    the best one when speed is what the policy was asked for.

    Each evaluated round gives every *scored* arm a value; an arm the evaluation skipped
    (gammas None: it could not have been the fastest), or under goodput one the cost model
    cannot price yet (it has not drafted: the first rounds of a run), earns nothing that
    round. `totals[i]` is what arm i earned over the rounds it was scored in, `scored[i]`
    how many those were, and `best` the largest total: a drafter is ranked only on what it
    earned, never on credit for rounds it did not play (crediting a skipped arm with the
    chosen arm's value, as before, let a drafter left out of most rounds be named best on
    a few good scored ones). Comparing per-round averages instead was rejected: they
    compare different rounds (a drafter scored only on easy stretches would average above
    one scored everywhere), and the regret could be positive when the learner played the
    best arm in every round.

    `regret` = max_i totals[i] - chosen_total, summed over the tracked rounds (`rounds`).
    Values are >= 0, so each total is a lower bound on what that arm would have earned in
    every round and the regret is never inflated by unearned credit; it is exactly the
    regret against the best fixed drafter when every arm is scored in every round, 0 when
    the learner always played the arm that was best (its total is the learner's), and
    negative only when switching beat every fixed drafter. Under "tok/s", regret / rounds
    is (at least) the mean per-round speed the best fixed drafter would have added. A round whose
    chosen arm has no value is not tracked (nothing to compare the others with)."""

    arms: list[str]
    unit: str = "tokens"
    totals: list[float] = field(default_factory=list)
    scored: list[int] = field(default_factory=list)  # rounds each arm was scored in
    chosen_total: float = 0.0
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.totals = [0.0] * len(self.arms)
        self.scored = [0] * len(self.arms)

    def add_round(self, chosen: int, gammas: Sequence[Sequence[float] | None], draft_tokens: int) -> None:
        """One evaluated round valued in accepted tokens: every arm's gammas at its committed
        positions, the first `draft_tokens` of which bound what a drafter could have had
        accepted (None: not scored, it earns nothing)."""
        self.add(chosen, [None if g is None else expected_accept_length(g[:draft_tokens]) for g in gammas])

    def add(self, chosen: int, values: Sequence[float | None]) -> None:
        """One evaluated round: each arm's value in `unit`, None for an arm not scored (or,
        under goodput, not yet priced). A round whose chosen arm has no value is not
        tracked: there is nothing to compare the others with."""
        if values[chosen] is None:
            return
        for i, value in enumerate(values):
            if value is not None:
                self.totals[i] += value
                self.scored[i] += 1
        self.chosen_total += values[chosen]
        self.chosen.append(chosen)

    @property
    def rounds(self) -> int:
        return len(self.chosen)

    @property
    def best(self) -> int:
        return max(range(len(self.arms)), key=self.totals.__getitem__)

    @property
    def regret(self) -> float:
        return max(self.totals) - self.chosen_total if self.chosen else 0.0

    @property
    def best_arm_share(self) -> float:
        return self.chosen.count(self.best) / len(self.chosen) if self.chosen else 0.0
