"""What a lookup draft's match length says about its acceptance (ARCHITECTURE.md, "Goodput",
lookup drafts trimmed by match length): acceptance by position per drafter and match
length, learned from the lookup drafts the round verified. The round planner trims a
lookup's draft by it (`RoundPlanner.trimmed_length`). Plain Python: no torch."""

from __future__ import annotations

import random
from typing import Sequence

from specdraft.learning.goodput import AcceptanceByPosition, best_draft_length, committed_by_length


class MatchAcceptance:
    """Acceptance by position of each arm's drafts from a match of length 1 .. BUCKETS - 1,
    and one bucket for longer matches."""

    BUCKETS = 8

    def __init__(self, arms: int, k_max: int, table: AcceptanceByPosition | None = None):
        self.arms, self.k_max = arms, k_max
        self.table = table or AcceptanceByPosition(arms * self.BUCKETS, k_max)

    def row(self, arm: int, match_length: int) -> int:
        return arm * self.BUCKETS + min(match_length, self.BUCKETS) - 1

    def observe(self, arm: int, match_length: int, alignment: Sequence[float]) -> None:
        self.table.observe(self.row(arm, match_length), alignment)

    def rates(self, arm: int, match_length: int, k: int, rng: random.Random | None = None) -> list[float]:
        """Positions 1 .. k: posterior means, or one draw with `rng` (AcceptanceByPosition.rates)."""
        return self.table.rates(self.row(arm, match_length), k, rng)

    def trimmed_length(self, arm: int, match_length: int, seconds: Sequence[float | None],
                       rng: random.Random) -> int:
        """How many tokens of a draft of len(seconds) - 1 from a match of `match_length` to
        verify, `seconds[j]` the round's cost with j of them. K was planned on the arm's
        acceptance over all its rounds, but a lookup's acceptance differs several-fold
        between a one-token match and a long one, and the match is only known once the
        lookup ran: the best length in 0 .. drafted (0: a plain round) under one posterior
        draw of the acceptance of the arm's drafts from matches this long (a draw, so a
        match length judged poor is still tried now and then); all of it while a cost is
        unknown or for a draft that is not a lookup's."""
        drafted = len(seconds) - 1
        if match_length <= 0 or drafted <= 0 or any(s is None or s <= 0 for s in seconds):
            return drafted
        rates = self.rates(arm, match_length, drafted, rng)
        return best_draft_length(committed_by_length(rates), seconds)

    def carried_over(self, rounds: float) -> "MatchAcceptance":
        return MatchAcceptance(self.arms, self.k_max, self.table.carried_over(rounds))

    def state(self) -> dict:
        return self.table.state()

    def load(self, state: dict) -> None:
        self.table.load(state, "match_acceptance")
