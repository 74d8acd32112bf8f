"""Draft lengths for a batch of requests verified in one engine step (serving engines).

One step verifies every running request's draft at once, so a drafted token's price is
what it adds to the *step*, paid by every request in it: `StepCosts` fits the step's
seconds as a line in the tokens it scheduled, fixed + slope x tokens, from this worker's
own steps. `plan_batch` then spends draft tokens where they raise the batch's committed
tokens per second: each request offers its next token at the chance that every drafted
token up to it survives; the surest go first, and a token is added only while its
expected gain per second of step it adds beats the batch's rate so far. At one request
on a step that costs the same at 1 or 9 tokens this drafts the whole confident chain; at a
concurrency where the step is priced by its tokens, only tokens nearly sure to be accepted
are worth their place, and a request may draft nothing.

No torch: plain Python, like the rest of `learning/`.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from specdraft.learning.goodput import _DecayedLine


class StepCosts:
    """Seconds of one engine step by the tokens it scheduled (decayed least squares, the
    slope shrunk by a ridge so a few wide steps cannot stop drafting for good)."""

    def __init__(self, decay: float = 0.98):
        self.line = _DecayedLine(decay, ridge=4.0)
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.line.add(float(tokens), seconds)
            self.steps += 1

    def fixed_and_slope(self) -> tuple[float, float] | None:
        """(seconds at 0 tokens, seconds per token), or None before two steps were seen."""
        if self.steps < 2:
            return None
        at0, at1 = self.line(0.0), self.line(1.0)
        if at0 is None or at1 is None:
            return None
        return at0, max(0.0, at1 - at0)


def survival(rates: Sequence[float]) -> list[float]:
    """P(tokens 1..m all accepted) for m = 1..len from conditional acceptance rates."""
    out, alive = [], 1.0
    for rate in rates:
        alive *= rate
        out.append(alive)
    return out


def plan_batch(chances: Sequence[Sequence[float]], costs: StepCosts, probe: int = 1) -> list[int]:
    """Per request, how many of its offered draft tokens to send. `chances[r][m]`: the
    probability that request r's drafted tokens 1..m+1 are all accepted (non-increasing);
    its length is what the request has on offer. Before the step's cost is known every
    request drafts `probe` tokens at most (a plain step teaches nothing about the slope)."""
    plan = [0] * len(chances)
    line = costs.fixed_and_slope()
    if line is None:
        return [min(probe, len(c)) for c in chances]
    fixed, slope = line
    tokens = float(len(chances))  # every request's bonus token is scheduled anyway
    expected = float(len(chances))
    if slope <= 0.0:  # a flat step: every offered token is free
        return [len(c) for c in chances]
    heap = [(-c[0], r) for r, c in enumerate(chances) if c]
    heapq.heapify(heap)
    while heap:
        negative, r = heapq.heappop(heap)
        chance = -negative
        # Worth it while the token's expected gain per second it adds beats the batch's rate.
        if chance * (fixed + slope * tokens) <= expected * slope:
            break
        plan[r] += 1
        tokens += 1
        expected += chance
        if plan[r] < len(chances[r]):
            heapq.heappush(heap, (-chances[r][plan[r]], r))
    return plan
