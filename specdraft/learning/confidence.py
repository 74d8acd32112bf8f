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

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def acceptance(self, confidence: float) -> float:
        """Estimated P(accepted | reached, drafter's confidence); the confidence itself is
        the prior, so an unseen bin trusts the drafter."""
        b = self._bin(confidence)
        return (self.hits[b] + confidence * self.prior_weight) / (self.seen[b] + self.prior_weight)

    def observe_one(self, confidence: float, accepted: bool) -> None:
        """One token reached (every earlier one accepted) and judged."""
        b = self._bin(confidence)
        self.seen[b] += 1
        self.hits[b] += accepted

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A finished draft: the first `accepted` tokens were accepted, the next one (if any)
        rejected; later ones were never reached, so they say nothing."""
        for j, confidence in enumerate(confidences[: accepted + 1]):
            b = self._bin(confidence)
            self.seen[b] += 1
            self.hits[b] += j < accepted


@dataclass(frozen=True)
class StopRule:
    """When a drafter stops, from the round cost model: a round that has drafted j tokens
    takes `T_j = base_seconds + j * per_token` (the verify of one token, plus each drafted
    token's draft and its share of the verify) and is expected to commit `E_j` tokens.
    Drafting token j + 1 adds P(it and every earlier one accepted) to E and `per_token` to
    T; it is worth it while it raises the round's rate E / T:

        (E_j + p) / (T_j + per_token) >= E_j / T_j   <=>   p * T_j >= E_j * per_token.

    Judging the next token against the planned round's rate instead would set the bar at
    the optimistic end: tokens that would raise this round's speed get cut (on a CPU,
    where each verified token costs a third of a plain step, it stopped drafts whose tokens
    were all being accepted). `price` is that planned-rate bar, for drafters whose
    confidence is a vote share rather than a calibrated probability (the suffix drafter's
    floor)."""

    base_seconds: float
    per_token: float
    price: float

    def worth(self, drafted: int, expected: float, survive_next: float) -> bool:
        """After `drafted` tokens (expected committed `expected`, bonus token included), is
        one more whose survival probability is `survive_next` worth drafting?"""
        return survive_next * (self.base_seconds + drafted * self.per_token) >= expected * self.per_token
