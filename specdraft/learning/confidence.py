"""How likely a drafter's token is to be accepted, given the drafter's own confidence in it
(its top probability): a calibration table learned online from the drafter's rounds.

Model-backed drafters stop drafting early when the chance that the next token survives
(every earlier one accepted, and this one) falls below what the token's time would buy
(ARCHITECTURE.md, "Goodput"). Raw top probabilities are poorly calibrated, a layer-skipping
drafter is often confidently wrong, so each drafter learns, per confidence bin, how
often its tokens were really accepted. Plain Python: no torch.
"""

from __future__ import annotations

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

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A finished draft: the first `accepted` tokens were accepted, the next one (if any)
        rejected; later ones were never reached, so they say nothing."""
        for j, confidence in enumerate(confidences[: accepted + 1]):
            b = self._bin(confidence)
            self.seen[b] += 1
            self.hits[b] += j < accepted


def worth_drafting(survive: float, acceptance: float, stop_price: float) -> bool:
    """Drafting one more token adds `survive * acceptance` expected committed tokens; it is
    worth it while that beats `stop_price` (the tokens its time would buy at the current rate)."""
    return survive * acceptance >= stop_price
