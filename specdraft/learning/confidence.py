"""How likely a drafter's token is to be accepted, given the drafter's own confidence in it
(its top probability): a calibration table learned online from the drafter's rounds.

Model-backed drafters stop drafting early when the chance that the next token survives
(every earlier one accepted, and this one) no longer pays for its time (`StopRule`;
ARCHITECTURE.md, "Goodput"). Raw top probabilities are poorly calibrated, a layer-skipping
drafter is often confidently wrong, so each drafter learns, per confidence bin, how
often its tokens were really accepted. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class ConfidenceCalibration:
    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.bins, self.prior_weight = bins, prior_weight
        self.hits = [0.0] * bins
        self.seen = [0.0] * bins

    def bin_of(self, confidence: float) -> int:
        """The bin of `hits` and `seen` that a token drafted with `confidence` counts in."""
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def acceptance(self, confidence: float) -> float:
        """Estimated P(accepted | reached, drafter's confidence); the confidence itself is
        the prior, so an unseen bin trusts the drafter."""
        b = self.bin_of(confidence)
        return (self.hits[b] + confidence * self.prior_weight) / (self.seen[b] + self.prior_weight)

    def observe_one(self, confidence: float, accepted: bool) -> None:
        """One token reached (every earlier one accepted) and judged."""
        b = self.bin_of(confidence)
        self.seen[b] += 1
        self.hits[b] += accepted

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A finished draft: the first `accepted` tokens were accepted, the next one (if any)
        rejected; later ones were never reached, so they say nothing."""
        for j, confidence in enumerate(confidences[: accepted + 1]):
            self.observe_one(confidence, j < accepted)


@dataclass(frozen=True)
class StopRule:
    """When a drafter stops, from the round cost model: a round that has drafted j tokens
    takes `seconds[j]` (its verify, padded to the cheapest width, plus j draft tokens) and
    is expected to commit `E_j` tokens (bonus included). Stopping after j tokens gives the
    rate `E_j / seconds[j]`; drafting on is worth it while some longer round m <= horizon
    is expected to do better: E_m adds, token by token, the chance that every token up to
    it survives, the next one's from the drafter's calibrated confidence and those after it
    from the arm's acceptance by position (`rates[m - 1]` = a(m)). The horizon reaches past
    the plan's K, so a run of sure tokens carries a draft beyond what the plan expected.

    Later tokens are judged by the position rates, not by the current token's confidence:
    a token's confidence says little about the tokens after it (measured: docs/policies.md).

    Looking ahead matters because verify costs are steps, not a line (a wider forward can
    cost far more than one token more, or less), so a rule that judged only the next token
    would stop at every step even when the round as planned is the fastest. Judging the
    next token against the planned round's rate instead would set the bar at the
    optimistic end and cut drafts whose tokens were all being accepted.
    `price` is that planned-rate bar per token, for drafters whose confidence is a vote
    share rather than a calibrated probability (the suffix drafter's floor)."""

    seconds: Sequence[float]  # [j] for j = 0 .. horizon
    rates: Sequence[float]  # [m - 1] = a(m), m = 1 .. horizon
    price: float

    @property
    def horizon(self) -> int:
        """The most tokens a draft judged by this rule may hold (at least the plan's K)."""
        return len(self.seconds) - 1

    def worth(self, drafted: int, expected: float, survive_next: float) -> bool:
        """After `drafted` tokens (expected committed `expected`, bonus token included), is
        the next one, whose survival probability is `survive_next`, worth drafting?"""
        if drafted >= len(self.seconds) - 1:
            return False
        stop_rate = expected / self.seconds[drafted]
        total, survive = expected, survive_next
        for m in range(drafted + 1, len(self.seconds)):
            total += survive
            if total / self.seconds[m] >= stop_rate:
                return True
            survive *= self.rates[m] if m < len(self.rates) else 0.0
        return False
