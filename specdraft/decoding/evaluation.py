"""Full-information evaluation (HedgeSpec's evaluation phase) against live drafters: gamma
of every drafter at every committed position of a batch of rounds.

Positions a drafter did not draft are scored in one forward per contiguous span, so
batching m rounds (`update_every`) costs one forward per drafter, not m; a drafter's own
draft alignment (the chosen one's, and in a tree round every branch's) is reused where it
equals its score. Under greedy decoding a drafter that drafts from token ids alone (the
lookups) is scored against the committed tokens, which are the target's argmax there, so
its gamma is exactly what the one-hot distribution would give, without building it (the
target's distributions are built only when some drafter is scored from them). Every
drafter ends caught up, so switching later costs nothing. One host sync reads everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdraft.core.sampling import SamplingParams, distributions
from specdraft.drafters.base import Drafter
from specdraft.learning.driver import Gammas, RoundOutcome


@dataclass(frozen=True)
class RoundEvidence:
    """What the live evaluator needs from a round besides its position."""

    # {arm: [n]} for each drafter that drafted in the round: its alignment at its first n
    # drafted positions, those whose context is the committed one
    alphas: dict[int, torch.Tensor]
    # [count, V] at the committed positions: the target's distributions when `processed`
    # (sampling: the verify computed them anyway), else its logits, turned into
    # distributions by the evaluator for all queued rounds at once (one transform per
    # evaluation instead of one per round, and none for rounds that are never scored)
    target: torch.Tensor
    processed: bool
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer: [count, H]} there


class PoolEvaluator:
    """Scores `drafters` on rounds committed to `context` (the live, growing token list);
    `params` turns the target's logits into the distributions the drafters are scored on."""

    def __init__(self, drafters: Sequence[Drafter], context: list[int], params: SamplingParams):
        self.drafters = drafters
        self.context = context
        self.params = params
        # The names are the ones `learning/driver.py` asks evaluators for.
        self.costly = [drafter.traits.scored_by_own_forward for drafter in drafters]
        self.from_hidden = [bool(drafter.hidden_layers) for drafter in drafters]
        # Greedy one-hot p: 1 - TV(p, q) of a token-id drafter is 1[its token == committed].
        # The plain arm proposes nothing (its gammas are 0 under any decoding): scored from
        # the distributions, it alone would make every greedy evaluation build them.
        self.by_tokens = [drafter.traits.drafts_nothing or (params.one_hot and drafter.traits.token_ids_only)
                          for drafter in drafters]

    def __call__(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool] = ()) -> list[Gammas]:
        batch = _Batch(rounds, self.params)
        # A drafter scored from hidden states is scored only where every round handed them
        # over (the engine asks for them per batch: `PolicyDriver.batch_skips`).
        scored = [i for i, drafter in enumerate(self.drafters)
                  if not (skip and skip[i]) and set(drafter.hidden_layers) <= batch.hidden.keys()]
        per_drafter = [torch.cat(self._score(i, self.drafters[i], batch)) for i in scored]
        flat = torch.cat(per_drafter).double().tolist() if per_drafter else []  # one sync
        total = batch.offsets[-1]
        rows: list[list[float] | None] = [None] * len(self.drafters)
        for n, i in enumerate(scored):
            rows[i] = flat[n * total : (n + 1) * total]
        out = []
        for round_, offset in zip(rounds, batch.offsets):
            out.append([None if row is None else row[offset : offset + round_.count] for row in rows])
        return out

    def silent(self, round_: RoundOutcome) -> list[bool]:
        """Per drafter: asleep at the round's start (`Drafter.awake_at`). The name is the one
        `learning/driver.py` asks evaluators for."""
        return [not drafter.awake_at(self.context, round_.start) for drafter in self.drafters]

    def _score(self, arm: int, drafter: Drafter, batch: "_Batch") -> list[torch.Tensor]:
        parts, first = [], 0  # rounds first..j-1: consecutive rounds whose positions the drafter must score
        for j, round_ in enumerate(batch.rounds):
            drafted = round_.evidence.alphas.get(arm)
            if drafted is None or not drafter.traits.draft_alignment_is_score:
                continue
            parts.extend(self._score_span(arm, drafter, batch, first, j))
            first = j + 1
            known = min(round_.count, drafted.shape[0])  # its draft scored these already
            parts.append(drafted[:known].to(batch.dtype))
            if round_.count > known:
                parts.append(self._scores(arm, drafter, batch, round_.start + known, batch.offsets[j] + known,
                                          batch.offsets[j + 1]))
        parts.extend(self._score_span(arm, drafter, batch, first, len(batch.rounds)))
        return parts

    def _score_span(self, arm: int, drafter: Drafter, batch: "_Batch", first: int, end: int) -> list[torch.Tensor]:
        """The drafter's scores on rounds first..end-1 (consecutive positions), one call."""
        if end <= first:
            return []
        return [self._scores(arm, drafter, batch, batch.rounds[first].start, batch.offsets[first], batch.offsets[end])]

    def _scores(self, arm: int, drafter: Drafter, batch: "_Batch", position: int, start: int, stop: int
                ) -> torch.Tensor:
        """Gammas at committed positions position.. (batch rows start..stop-1)."""
        if self.by_tokens[arm]:
            return torch.tensor(drafter.committed_scores(self.context, position, stop - start), dtype=batch.dtype,
                                device=batch.device)
        return drafter.score(self.context, position, stop - start, *batch.rows(start, stop))


class _Batch:
    """The queued rounds' evidence laid end to end: the target's distributions [positions,
    V] and hidden states, built once per evaluation and shared by every drafter (a span of
    consecutive rounds is then a slice, not a copy)."""

    def __init__(self, rounds: Sequence[RoundOutcome], params: SamplingParams):
        self.rounds = rounds
        self.offsets = [0]
        for round_ in rounds:
            self.offsets.append(self.offsets[-1] + round_.count)
        evidence: list[RoundEvidence] = [r.evidence for r in rounds]
        self.evidence, self.params = evidence, params
        # What the distributions come in (a half-precision target's are float32: `distributions`).
        self.dtype = torch.float32 if evidence[0].target.dtype in (torch.float16, torch.bfloat16) \
            else evidence[0].target.dtype
        self.device = evidence[0].target.device  # where every drafter's scores are laid end to end
        self._probs: torch.Tensor | None = None
        # (Every round of a batch hands over the same layers: `PolicyDriver.batch_skips`.)
        layers = set.intersection(*(set(e.hidden) for e in evidence)) if evidence else set()
        self.hidden = {layer: torch.cat([e.hidden[layer] for e in evidence]) for layer in sorted(layers)}

    @property
    def probs(self) -> torch.Tensor:
        """The target's distributions at every batch position [positions, V], built on first use."""
        if self._probs is None:
            raw = [e.target for e in self.evidence if not e.processed]
            turned = iter(distributions(torch.cat(raw), self.params).split([t.shape[0] for t in raw])) if raw \
                else iter(())
            self._probs = torch.cat([e.target if e.processed else next(turned) for e in self.evidence])
        return self._probs

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The target's distributions and hidden states at batch positions start..stop-1."""
        return self.probs[start:stop], {layer: h[start:stop] for layer, h in self.hidden.items()}
