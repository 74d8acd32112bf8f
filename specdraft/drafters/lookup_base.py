"""The base of the drafters that draft by looking the context up in text (`ngram`,
`suffix`).

A kind implements one thing, `lookup`: the tokens that continue the context at a position.
Drafting is then on the host and deterministic (q one-hot, so acceptance stays lossless
under sampling), full-information scoring costs no forward, and where the lookup finds
nothing the drafter proposes nothing: it may sleep.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Callable, Sequence

import torch

from specdraft.drafters.base import Draft, Drafter, DrafterTraits, Hidden, TrajectoryScores
from specdraft.learning.confidence import StopRule


class LookupDrafter(Drafter):
    traits = DrafterTraits(may_sleep=True, token_ids_only=True)

    @abstractmethod
    def lookup(self, context: Sequence[int], position: int, k: int, stop_price: float | None = None) -> list[int]:
        """Up to k tokens continuing context[:position], none where nothing matches; reads
        nothing at or after `position`. `stop_price`: the round's early-stop floor on the
        draft's confidence (`StopRule.price`), for a kind that has one."""

    last_match = 0  # the match length behind the last lookup's tokens (a kind sets it)

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        tokens = self.lookup(context, len(context), k, stop.price if stop else None)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.ctx.device), None,
                     match_length=self.last_match if tokens else 0)

    def awake_at(self, context: Sequence[int], position: int) -> bool:
        return bool(self.lookup(context, position, 1))

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        # A draft is one lookup's whole span, so each position is scored by the one token a
        # fresh lookup there would propose: gamma = p(proposal), 0 where it finds nothing.
        proposals = []
        for position in range(start, start + count):
            first = self.lookup(context, position, 1)
            proposals.append(first[0] if first else -1)
        tokens = torch.tensor(proposals, dtype=torch.long, device=target_probs.device)
        picked = target_probs.gather(-1, tokens.clamp_min(0).view(-1, 1)).squeeze(-1)
        return torch.where(tokens >= 0, picked, torch.zeros_like(picked))

    def committed_scores(self, context: Sequence[int], start: int, count: int) -> list[float]:
        # The fresh lookup's token at each position against the token committed there.
        out = []
        for position in range(start, start + count):
            first = self.lookup(context, position, 1)
            out.append(1.0 if first and first[0] == context[position] else 0.0)
        return out

    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        self.reset()  # another prompt's text must not stand in for this one's
        return proposal_trajectory_scores(lambda position: self.lookup(context, position, k),
                                          context, prompt_len, target_probs)


def proposal_trajectory_scores(draft_at: Callable[[int], list[int]], context: Sequence[int], prompt_len: int,
                               target_probs: torch.Tensor) -> TrajectoryScores:
    """`trajectory_scores` of a deterministic drafter from what it would draft at each
    generated position (`draft_at(position)`): its run is the drafted prefix that matches
    the trajectory, its span the target's probability of each drafted token."""
    n = len(context) - prompt_len
    scores = TrajectoryScores([], [], [], [])
    for t in range(n):
        position = prompt_len + t
        proposal = draft_at(position)
        r = 0
        while r < len(proposal) and t + r < n and proposal[r] == context[position + r]:
            r += 1
        rows = [(t + j, token) for j, token in enumerate(proposal) if t + j < n]
        values = target_probs[[i for i, _ in rows], [tok for _, tok in rows]].tolist() if rows else []
        scores.drafted.append(len(proposal))
        scores.run.append(r)
        scores.span.append(values)
        scores.alpha.append(values[0] if values else 0.0)
    return scores
