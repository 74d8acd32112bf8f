"""Alignment feedback in plain Python: what policies learn from (ARCHITECTURE.md, "Feedback").

- alpha_j = 1 - TV(p_j, q_j): the probability drafted position j would be accepted.
- BD reward (MetaSD): mean alpha over the chosen drafter's drafted positions.
- BE reward (MetaSD): accepted / drafted.
- Expected acceptance length (HedgeSpec Theorem 3), unbiased from one trajectory:
  EAL = sum_{k=1..m+1} k (1 - g_k) prod_{j<k} g_j, with g_{m+1} = 0.
- Chunk losses: 1 - EAL / (K + 1) (length) or mean(1 - g) (acceptance rate).
- Regret against the best fixed drafter in hindsight, from per-round EAL of every drafter.
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
    """Cumulative expected accepted length of every arm versus the arms actually chosen."""

    arms: list[str]
    totals: list[float] = field(default_factory=list)
    chosen_total: float = 0.0
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.totals = [0.0] * len(self.arms)

    def add_round(self, chosen: int, gammas: Sequence[Sequence[float] | None], draft_tokens: int) -> None:
        """One evaluated round: every arm's gammas at its committed positions, the first
        `draft_tokens` of which bound what a drafter could have had accepted. An arm not
        scored (None: skipped, it could not have been the fastest) counts as the chosen
        arm did, so its regret does not move."""
        eal = [None if g is None else expected_accept_length(g[:draft_tokens]) for g in gammas]
        mine = eal[chosen] if eal[chosen] is not None else 1.0
        self.add(chosen, [mine if value is None else value for value in eal])

    def add(self, chosen: int, eal: Sequence[float]) -> None:
        for i, value in enumerate(eal):
            self.totals[i] += value
        self.chosen_total += eal[chosen]
        self.chosen.append(chosen)

    @property
    def best(self) -> int:
        return max(range(len(self.arms)), key=self.totals.__getitem__)

    @property
    def regret(self) -> float:
        return max(self.totals) - self.chosen_total if self.chosen else 0.0

    @property
    def best_arm_share(self) -> float:
        return self.chosen.count(self.best) / len(self.chosen) if self.chosen else 0.0
