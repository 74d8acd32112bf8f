"""Draft lengths for a batch of requests verified in one engine step (serving engines).

One step verifies every running request's draft at once, so a drafted token's price is
what it adds to the *step*, paid by every request in it: `StepCosts` fits the step's
seconds from what it scheduled (one price per request, another per draft token) from this
worker's own steps. `plan_batch` then spends draft tokens where they raise the batch's
committed tokens per second: each request offers its next token at the chance that every drafted
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

from specdraft.learning.goodput import AcceptanceByPosition


class StepCosts:
    """Seconds of one engine step from what it scheduled: fixed + per request x requests +
    per draft token x draft tokens, by decayed least squares (the two slopes shrunk by a
    ridge, so a few wide steps cannot stop drafting for good).

    Requests and draft tokens get a price each because they cost differently: a request's
    token brings its own sampling, bookkeeping and attention over its context, a draft
    token only one more row of the forward. One price per scheduled token would charge a
    draft token what a request costs (and at a steady concurrency the request count, not
    drafting, moves the step's size)."""

    def __init__(self, decay: float = 0.98, ridge: float = 4.0):
        self.decay, self.ridge = decay, ridge
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xy = [0.0] * 3
        self.steps = 0

    def observe(self, requests: int, drafted: int, seconds: float) -> None:
        if requests <= 0 or seconds <= 0:
            return
        x = (1.0, float(requests), float(drafted))
        for i in range(3):
            self.xy[i] = self.decay * self.xy[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.decay * self.xx[i][j] + x[i] * x[j]
        self.steps += 1

    def prices(self) -> tuple[float, float, float] | None:
        """(fixed, per request, per draft token) in seconds, or None before two steps."""
        if self.steps < 2:
            return None
        a = [row[:] for row in self.xx]
        b = self.xy[:]
        for i in (1, 2):  # the ridge shrinks the two prices, not the fixed part
            a[i][i] += self.ridge
        solved = _solve3(a, b)
        if solved is None:
            return None
        fixed, per_request, per_draft = solved
        per_request, per_draft = max(0.0, per_request), max(0.0, per_draft)
        if fixed < 0:  # a negative intercept is noise: keep the mean step's cost
            fixed = 0.0
        return fixed, per_request, per_draft


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b for a 3 x 3 system (Gaussian elimination with partial pivoting)."""
    n = 3
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


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
    prices = costs.prices()
    if prices is None:
        return [min(probe, len(c)) for c in chances]
    fixed, per_request, per_draft = prices
    seconds = fixed + per_request * len(chances)
    expected = float(len(chances))  # every request commits its bonus token
    if per_draft <= 0.0:  # a draft token costs nothing measurable: every offered one is free
        return [len(c) for c in chances]
    heap = [(-c[0], r) for r, c in enumerate(chances) if c]
    heapq.heapify(heap)
    while heap:
        negative, r = heapq.heappop(heap)
        chance = -negative
        # Worth it while the token's expected gain per second it adds beats the batch's rate.
        if chance * seconds <= expected * per_draft:
            break
        plan[r] += 1
        seconds += per_draft
        expected += chance
        if plan[r] < len(chances[r]):
            heapq.heappush(heap, (-chances[r][plan[r]], r))
    return plan


# Match-length buckets (lower edges): a lookup continuing a 1-token match is right far less
# often than one continuing 8 tokens, and the bucket tells the two apart.
MATCH_EDGES = (1, 2, 3, 4, 6, 9, 16)

# How the request's last sent draft fared: acceptance runs in stretches (a request copying
# its input keeps copying; one that just parted from it keeps missing), so the last outcome
# tells a sure match from a lucky one better than the match alone.
NO_DRAFT_YET, ALL_ACCEPTED, PART_ACCEPTED, FIRST_REJECTED = range(4)
OUTCOMES = 4


def draft_outcome(sent: int, accepted: int) -> int:
    if sent <= 0:
        return NO_DRAFT_YET
    if accepted >= sent:
        return ALL_ACCEPTED
    return PART_ACCEPTED if accepted > 0 else FIRST_REJECTED


class MatchCalibration:
    """Acceptance by draft position per drafter, match length and the request's last draft
    outcome, learned from every request a worker serves: the chance a request offers for
    its draft tokens. The drafter's average acceptance would price a sure long match and a
    guess from one token alike; at a concurrency where only sure tokens pay, that sends the
    guesses and withholds the sure ones."""

    def __init__(self, arms: int, k_max: int, decay: float = 0.995):
        self.table = AcceptanceByPosition(arms * len(MATCH_EDGES) * OUTCOMES, k_max, decay=decay)

    def _index(self, arm: int, match_length: int, outcome: int) -> int:
        bucket = max(i for i, edge in enumerate(MATCH_EDGES) if match_length >= edge or i == 0)
        return (arm * len(MATCH_EDGES) + bucket) * OUTCOMES + outcome

    def state(self) -> dict:
        return self.table.state()

    def load(self, state: dict) -> None:
        """ValueError on a table of another shape (another pool, draft length or version)."""
        self.table.load(state)

    def observe(self, arm: int, match_length: int, outcome: int, alignment: Sequence[float]) -> None:
        self.table.observe(self._index(arm, match_length, outcome), alignment)

    def chances(self, arm: int, match_length: int, outcome: int, k: int) -> list[float]:
        """P(draft tokens 1..m all accepted), m = 1..k, for a draft of `arm` behind a match
        of `match_length` tokens, the request's last draft having fared `outcome`."""
        return survival(self.table.rates(self._index(arm, match_length, outcome), k))
