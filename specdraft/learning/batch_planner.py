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
are worth their place, and a request may draft nothing. A request with several drafters'
offers sends one (`plan_offers`: the most sure tokens at the batch's price), and the
chances come from `MatchCalibration`, an online logistic model of acceptance.

No torch: plain Python, like the rest of `learning/`.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from specdraft.learning.goodput import is_number


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
    prices = costs.prices()
    if prices is None:
        return [min(probe, len(c)) for c in chances]
    return _fill(chances, prices)[0]


def _fill(chances: Sequence[Sequence[float]], prices: tuple[float, float, float]) -> tuple[list[int], float]:
    """`plan_batch` at known prices, and the chance a further token would have needed to
    be sent (the batch's marginal price of a draft token in accepted tokens)."""
    fixed, per_request, per_draft = prices
    plan = [0] * len(chances)
    seconds = fixed + per_request * len(chances)
    expected = float(len(chances))  # every request commits its bonus token
    if per_draft <= 0.0:  # a draft token costs nothing measurable: every offered one is free
        return [len(c) for c in chances], 0.0
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
    return plan, expected * per_draft / seconds


def plan_offers(offers: Sequence[Sequence[Sequence[float]]], costs: StepCosts, probe: int = 1) -> list[tuple[int, int]]:
    """Per request, which of its offered drafts to send and how many of its tokens:
    `offers[r][i]` is request r's i-th draft's chances (as in `plan_batch`), the first its
    policy's choice. A request sends at most one draft: the one whose tokens beat the
    batch's marginal price by the most (ties and unknown prices: the policy's), found at
    the price its policy's drafts alone set, then the batch is planned on the chosen ones.
    At one request the price is near 0 and the surest long draft wins; at a concurrency
    where a draft token costs nearly what it can earn, the draft with the most sure tokens."""
    prices = costs.prices()
    firsts = [o[0] if o else [] for o in offers]
    if prices is None:
        return [(0, min(probe, len(c))) for c in firsts]
    _, price = _fill(firsts, prices)
    chosen = [max(range(len(o)), key=lambda i: (_surplus(o[i], price), -i)) if o else 0 for o in offers]
    plan, _ = _fill([o[i] if o else [] for o, i in zip(offers, chosen)], prices)
    return list(zip(chosen, plan))


def _surplus(chances: Sequence[float], price: float) -> float:
    return sum(c - price for c in chances if c > price)


# Match-length buckets (lower edges): a lookup continuing a 1-token match is right far less
# often than one continuing 8 tokens, and the bucket tells the two apart.
MATCH_EDGES = (1, 2, 3, 4, 6, 9, 16)

# How the request's last sent draft fared: acceptance runs in stretches (a request copying
# its input keeps copying; one that just parted from it keeps missing), so the last outcome
# tells a sure match from a lucky one better than the match alone.
NO_DRAFT_YET, ALL_ACCEPTED, PART_ACCEPTED, FIRST_REJECTED = range(4)
OUTCOMES = 4

# Draft positions told apart (later ones share the last weight).
POSITIONS = 6

# What the request's other drafters offer at the same step: two lookups in different text
# that continue alike are right far more often than one alone, and where they part at
# most one of them is.
ALONE, AGREED, DISAGREED = range(3)
SUPPORTS = 3


def support(first: int, others_first: Sequence[int]) -> int:
    """ALONE without other offers; AGREED when another offer starts with the same token."""
    if not others_first:
        return ALONE
    return AGREED if first in others_first else DISAGREED


def draft_outcome(sent: int, accepted: int) -> int:
    if sent <= 0:
        return NO_DRAFT_YET
    if accepted >= sent:
        return ALL_ACCEPTED
    return PART_ACCEPTED if accepted > 0 else FIRST_REJECTED


class MatchCalibration:
    """The chance that a request's draft token is accepted, given the tokens before it were:
    a logistic model of the drafter, the token's place in the draft, the lookup's match
    length, the request's last draft outcome and whether the request's other drafters start
    alike, learned online from every offered draft of every request a worker serves. The
    drafter's average acceptance would price a sure long match and a guess from one token
    alike; at a concurrency where only sure tokens pay, that sends the guesses and
    withholds the sure ones. A weight per feature rather than a table per combination: the
    combinations are many (drafters x matches x outcomes x supports x positions) and most
    are seldom seen, and a sparse table's lucky cells are the ones the plan picks, so its
    chances came out above what the sent tokens achieved."""

    def __init__(self, arms: int, k_max: int, learning_rate: float = 0.2, memory: float = 0.999):
        self.arms, self.k_max = arms, k_max
        self.learning_rate, self.memory = learning_rate, memory
        # Feature offsets: bias, arm, position, log match, match >= edge, outcome, support.
        self._arm = 1
        self._position = self._arm + arms
        self._log_match = self._position + POSITIONS
        self._edges = self._log_match + 1
        self._outcome = self._edges + len(MATCH_EDGES) - 1
        self._support = self._outcome + OUTCOMES
        self.size = self._support + SUPPORTS
        self.weights = [0.0] * self.size
        self.squares = [1e-2] * self.size  # decayed sums of squared gradients (AdaGrad-like steps)

    def _active(self, arm: int, match_length: int, outcome: int, supported: int) -> list[tuple[int, float]]:
        """The features that do not depend on the position, as (index, value)."""
        active = [(0, 1.0), (self._arm + arm, 1.0), (self._log_match, math.log1p(match_length)),
                  (self._outcome + outcome, 1.0), (self._support + supported, 1.0)]
        active += [(self._edges + i, 1.0) for i, edge in enumerate(MATCH_EDGES[1:]) if match_length >= edge]
        return active

    def rates(self, arm: int, match_length: int, outcome: int, supported: int, k: int) -> list[float]:
        """P(token m accepted | tokens before it were), m = 1..k."""
        w = self.weights
        base = sum(w[i] * v for i, v in self._active(arm, match_length, outcome, supported))
        return [_sigmoid(base + w[self._position + min(m, POSITIONS - 1)]) for m in range(k)]

    def chances(self, arm: int, match_length: int, outcome: int, supported: int, k: int) -> list[float]:
        """P(draft tokens 1..m all accepted), m = 1..k, for a draft of `arm` behind a match
        of `match_length` tokens, the request's last draft having fared `outcome`, the
        other drafters' offers `supported` it (ALONE, AGREED, DISAGREED)."""
        return survival(self.rates(arm, match_length, outcome, supported, k))

    def observe(self, arm: int, match_length: int, outcome: int, supported: int, alignment: Sequence[float]) -> None:
        """`alignment[m]`: 1.0 where token m + 1 was accepted, 0.0 at the first rejection
        (nothing after it: a token after a rejected one was never tried)."""
        active = self._active(arm, match_length, outcome, supported)
        w, squares = self.weights, self.squares
        for m, value in enumerate(alignment[: self.k_max]):
            features = [*active, (self._position + min(m, POSITIONS - 1), 1.0)]
            error = _sigmoid(sum(w[i] * x for i, x in features)) - value
            for i, x in features:
                gradient = error * x
                squares[i] = self.memory * squares[i] + gradient * gradient
                w[i] -= self.learning_rate * gradient / math.sqrt(squares[i])
            if value == 0.0:
                break

    def state(self) -> dict:
        return {"weights": list(self.weights), "squares": list(self.squares)}

    def load(self, state: dict) -> None:
        """ValueError on a model of another shape (another pool, or an older state file)."""
        if not isinstance(state, dict):
            raise ValueError("state field serving_calibration: expected an object with weights and squares")
        for key in ("weights", "squares"):
            values = state.get(key)
            if not (isinstance(values, list) and len(values) == self.size
                    and all(is_number(v) and math.isfinite(v) for v in values)):
                raise ValueError(f"state field serving_calibration.{key}: expected {self.size} numbers "
                                 "(a state file from another pool or an older specdraft)")
        if any(v <= 0 for v in state["squares"]):
            raise ValueError("state field serving_calibration.squares: expected positive numbers")
        self.weights = [float(v) for v in state["weights"]]
        self.squares = [float(v) for v in state["squares"]]


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)
