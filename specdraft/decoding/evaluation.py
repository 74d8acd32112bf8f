"""Full-information evaluation (HedgeSpec's evaluation phase) against live drafters: gamma
of every drafter at every committed position of a batch of rounds.

Positions a drafter did not draft are scored in one forward per contiguous span, so
batching m rounds (`update_every`) costs one forward per drafter, not m; a drafter's own
draft alignment (the chosen one's, and in a tree round every branch's) is reused where it
equals its score. Every drafter ends
caught up, so switching later costs nothing. One host sync reads everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdraft.drafters.base import Drafter
from specdraft.learning.driver import Gammas, RoundOutcome


@dataclass(frozen=True)
class RoundEvidence:
    """What the live evaluator needs from a round besides its position."""

    # {arm: [n]} for each drafter that drafted in the round: its alignment at its first n
    # drafted positions, those whose context is the committed one
    alphas: dict[int, torch.Tensor]
    target_probs: torch.Tensor  # [count, V] the target's distributions at the committed positions
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer: [count, H]} there


class PoolEvaluator:
    """Scores `drafters` on rounds committed to `context` (the live, growing token list)."""

    def __init__(self, drafters: Sequence[Drafter], context: list[int]):
        self.drafters = drafters
        self.context = context
        # The name is the one `learning/driver.py` asks evaluators for.
        self.costly = [drafter.scored_by_own_forward for drafter in drafters]

    def __call__(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool] = ()) -> list[Gammas]:
        scored = [i for i in range(len(self.drafters)) if not (skip and skip[i])]
        per_drafter = [torch.cat(self._score(i, self.drafters[i], rounds)) for i in scored]
        flat = torch.cat(per_drafter).double().tolist() if per_drafter else []  # one sync
        total = sum(r.count for r in rounds)
        rows: list[list[float] | None] = [None] * len(self.drafters)
        for n, i in enumerate(scored):
            rows[i] = flat[n * total : (n + 1) * total]
        out, offset = [], 0
        for round_ in rounds:
            out.append([None if row is None else row[offset : offset + round_.count] for row in rows])
            offset += round_.count
        return out

    def silent(self, round_: RoundOutcome) -> list[bool]:
        """Per drafter: asleep at the round's start (`Drafter.awake_at`). The name is the one
        `learning/driver.py` asks evaluators for."""
        return [not drafter.awake_at(self.context, round_.start) for drafter in self.drafters]

    def _score(self, arm: int, drafter: Drafter, rounds: Sequence[RoundOutcome]) -> list[torch.Tensor]:
        parts, span = [], []  # span: consecutive rounds whose positions the drafter must score
        for round_ in rounds:
            evidence: RoundEvidence = round_.evidence
            drafted = evidence.alphas.get(arm)
            if drafted is None or not drafter.draft_alignment_is_score:
                span.append(round_)
                continue
            parts.extend(self._score_span(drafter, span))
            span = []
            known = min(round_.count, drafted.shape[0])  # its draft scored these already
            parts.append(drafted[:known].to(evidence.target_probs.dtype))
            if round_.count > known:
                hidden = {layer: h[known:] for layer, h in evidence.hidden.items()}
                parts.append(drafter.score(self.context, round_.start + known, round_.count - known,
                                           evidence.target_probs[known:], hidden))
        parts.extend(self._score_span(drafter, span))
        return parts

    def _score_span(self, drafter: Drafter, span: list[RoundOutcome]) -> list[torch.Tensor]:
        if not span:
            return []
        probs = torch.cat([r.evidence.target_probs for r in span])  # [positions, V]
        hidden = {layer: torch.cat([r.evidence.hidden[layer] for r in span]) for layer in span[0].evidence.hidden}
        return [drafter.score(self.context, span[0].start, sum(r.count for r in span), probs, hidden)]
