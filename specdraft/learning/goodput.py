"""Speed as the objective (ARCHITECTURE.md, "Goodput"): an online round cost model, each
drafter's acceptance by draft position, and the draft length that maximises goodput.

- Round cost `T(i, K) = c_verify(K + 1) + K * c_draft(i)`: the verify cost of a forward
  over K + 1 tokens, and draft cost per token per drafter (a moving average).
  `c_verify` is a measured cost curve by width (`VerifyCosts`), scaled online to this
  run's timings: a forward's cost is not a line in its width (BLAS switches kernels by
  matrix shape, GPUs compute in tiles), so a wider forward can be cheaper than a narrower
  one; the verify pads a width to any wider one that is cheaper, and `c_verify(w)` is the
  cheapest width >= w.
  Without a measured curve, a line fitted to the verify timings (fixed + per token).
- Acceptance by position `a_i(m)` = P(position m accepted | positions before it accepted),
  from the chosen drafter's alignment up to its first rejection and, under full
  information, from every drafter's gammas along the committed chunk.
- Goodput `G(i, K) = E[committed | i, K] / T(i, K)` with
  `E[committed | i, K] = 1 + sum_{j<=K} prod_{m<=j} a_i(m)`; K = 0 is plain decoding.
Plain Python: no torch.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from specdraft.learning.feedback import probability


class _DecayedLine:
    """Least-squares line y = fixed + slope * x over decayed observations (slope, fixed >= 0).

    The slope is shrunk towards 0 by a ridge of `ridge` pseudo-observations of unit width
    variance: a few wide rounds among many narrow ones must not fix a steep slope (noise
    would then make every draft look too dear, no round would draft again, and no wider
    round would ever correct it). Optimism about the slope keeps widths explored."""

    def __init__(self, decay: float, ridge: float = 1.0):
        self.decay, self.ridge = decay, ridge
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def __call__(self, x: float) -> float | None:
        if self.w == 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        # One width seen so far: no slope to learn yet, the cost is flat at the mean.
        slope = max(0.0, (self.sxy / self.w - mx * my) / (var + self.ridge / self.w)) if var > 1e-9 else 0.0
        return max(0.0, my - slope * mx) + slope * x

    def state(self) -> list[float]:
        return [self.w, self.sx, self.sy, self.sxx, self.sxy]

    def load(self, values: list[float]) -> None:
        w, sx, sy, sxx, sxy = (float(v) for v in values)
        if w < 0 or sx < 0 or sy < 0 or sxx < 0:  # weights, widths and seconds: never negative
            raise ValueError("state field costs.verify: a negative count, width or time")
        self.w, self.sx, self.sy, self.sxx, self.sxy = w, sx, sy, sxx, sxy


class VerifyCosts:
    """Seconds of a verify forward over w tokens: `scale * shape[w]` once a measured cost
    curve (`shape`, seconds by width from `models/width_costs.py`) is installed, with
    `scale` tracking this run's timings (contexts grow, machines are shared); before that,
    a decayed line fitted to the observed verify timings.

    The verify pads a forward of w tokens to `padded_width(w)`, the cheapest width >= w
    (a BLAS kernel switch can make 16 rows cheaper than 9), so `__call__(w)` is that
    width's cost: non-decreasing in w, which is what the draft length and the early stop
    plan with."""

    # A wider forward is used only when it is this much cheaper: timings are noisy and a
    # wider forward does more arithmetic for nothing when the two really cost the same.
    MARGIN = 0.95
    # A curve measured while the machine was busy (or on another day's memory bandwidth) is
    # off by a factor, not by noise: when the median of the last RECENT verifies is off the
    # tracked scale by more than OFF, the scale jumps to it instead of creeping there.
    RECENT = 5
    OFF = 1.5

    def __init__(self, decay: float):
        self.line = _DecayedLine(decay)
        self.decay = decay
        self.shape: list[float] | None = None  # [w] seconds, index 0 unused
        self.pad_to: list[int] = []
        self.scale = 1.0
        self.recent: list[float] = []  # the last RECENT ratios of a verify's time to the curve's

    def install(self, shape: Sequence[float]) -> None:
        """A measured curve: `shape[w - 1]` = seconds of a forward over w tokens."""
        curve = [0.0, *(float(s) for s in shape)]
        if len(curve) < 2 or any(s <= 0 for s in curve[1:]):
            raise ValueError("a verify cost curve needs a positive time per width")
        self.shape, self.scale, self.recent = curve, 1.0, []
        # pad_to[w]: the cheapest width from w up, when it beats w itself by the margin.
        widest = len(curve) - 1
        self.pad_to = [0] * (widest + 1)
        for w in range(1, widest + 1):
            cheapest = min(range(w, widest + 1), key=lambda v: (curve[v], v))
            self.pad_to[w] = cheapest if curve[cheapest] < self.MARGIN * curve[w] else w

    def padded_width(self, width: int) -> int:
        """The width to run a forward of `width` tokens at (itself unless a wider one is cheaper)."""
        if self.shape is None or width >= len(self.pad_to) or width < 1:
            return width
        return self.pad_to[width]

    def add(self, width: int, seconds: float) -> None:
        """A verify over `width` tokens (after padding) took `seconds`."""
        self.line.add(width, seconds)
        if self.shape is not None and 0 < width < len(self.shape) and math.isfinite(seconds) and seconds > 0:
            ratio = seconds / self.shape[width]
            self.scale = self.decay * self.scale + (1 - self.decay) * ratio
            self.recent = [*self.recent[-(self.RECENT - 1):], ratio]
            if len(self.recent) == self.RECENT:
                median = sorted(self.recent)[self.RECENT // 2]
                if not 1 / self.OFF <= median / self.scale <= self.OFF:
                    self.scale = median

    def __call__(self, width: int) -> float | None:
        if self.shape is None or width >= len(self.shape):
            return self.line(width)
        return self.scale * self.shape[self.padded_width(width)]

    def state(self) -> list[float]:
        return self.line.state()

    def load(self, values: list[float]) -> None:
        self.line.load(values)


class RoundCostModel:
    """Seconds a round takes: `T(arm, K) = c_verify(K + 1) + K * c_draft(arm)`."""

    LOADED_WEIGHT = 4.0  # rounds of evidence a loaded draft cost counts as

    def __init__(self, arms: int, decay: float = 0.95):
        self.verify = VerifyCosts(decay)
        self.draft: list[float | None] = [None] * arms  # seconds per drafted token
        # The decayed count of rounds behind each draft cost: a decayed mean of all rounds so
        # far, so the first round (often a prompt's catch-up, its cost hard to split from the
        # draft's) weighs as one round among them, not as the starting point a plain moving
        # average would keep for dozens of rounds.
        self.draft_weight = [0.0] * arms
        self.decay = decay
        self.tree_extra = 0.0  # seconds a tree round's verify takes beyond a chain's of its width
        self.tree_weight = 0.0

    def observe(self, arm: int, drafted: int, draft_seconds: float, verify_seconds: float,
                verify_width: int = 0, branch_drafts: Sequence[tuple[int, int, float]] = ()) -> None:
        """`verify_width`: the tokens the verify forward ran over (0: drafted + 1, unpadded);
        `branch_drafts`: a tree round's further chains, (arm, drafted, seconds) each, whose
        verify teaches `tree_extra`, not the chain's cost curve."""
        if branch_drafts:
            self.observe_tree(verify_width, verify_seconds)
        else:
            self.verify.add(verify_width or drafted + 1, verify_seconds)
        self.observe_draft(arm, drafted, draft_seconds)
        for branch, tokens, seconds in branch_drafts:
            self.observe_draft(branch, tokens, seconds)

    def observe_tree(self, width: int, verify_seconds: float) -> None:
        """A tree round's verify over `width` rows took `verify_seconds`: what it took beyond
        a chain's verify of that width (merging the chains, the walk's host reads) is learned
        apart, so the chain's cost curve stays the chain's."""
        chain = self.verify(width)
        if chain is not None:  # a decayed mean over tree rounds, as draft costs are kept
            weight = self.decay * self.tree_weight
            self.tree_extra = (weight * self.tree_extra + max(0.0, verify_seconds - chain)) / (weight + 1)
            self.tree_weight = weight + 1

    def observe_draft(self, arm: int, drafted: int, draft_seconds: float) -> None:
        """`arm` drafted `drafted` tokens in `draft_seconds` (a tree round's branches too)."""
        if drafted:
            per_token = draft_seconds / drafted
            weight = self.decay * self.draft_weight[arm]
            self.draft[arm] = (weight * (self.draft[arm] or 0.0) + per_token) / (weight + 1)
            self.draft_weight[arm] = weight + 1

    def round_seconds(self, arm: int, k: int) -> float | None:
        """Estimated T(arm, k), or None before any verify was timed or, for k > 0, before the
        arm ever drafted."""
        verify = self.verify(k + 1)
        if verify is None or (k > 0 and self.draft[arm] is None):
            return None
        return verify + k * (self.draft[arm] or 0.0)

    def seconds_by_length(self, arm: int, cap: int) -> list[float | None]:
        """`round_seconds(arm, k)` for k = 0 .. cap in one pass: the estimates ask for a
        whole row at a time (each verify width's cost is looked up once)."""
        draft = self.draft[arm]
        out: list[float | None] = []
        for k in range(cap + 1):
            verify = self.verify(k + 1)
            out.append(None if verify is None or (k > 0 and draft is None) else verify + k * (draft or 0.0))
        return out

    def token_seconds(self, arm: int, k: int) -> float | None:
        """What a drafted token adds to a round of `k` tokens, on average: its draft plus
        its share of the verify."""
        draft, one, wide = self.draft[arm], self.verify(1), self.verify(k + 1)
        if draft is None or one is None or wide is None:
            return None
        return draft + max(0.0, wide - one) / max(1, k)

    def state(self) -> dict:
        return {"verify": self.verify.state(), "draft": list(self.draft)}

    def load(self, state: dict) -> None:
        verify, draft = state.get("verify"), state.get("draft")
        if not (isinstance(verify, list) and len(verify) == 5 and all(is_number(v) for v in verify)):
            raise ValueError("state field costs.verify: expected 5 numbers")
        if not (isinstance(draft, list) and len(draft) == len(self.draft)
                and all(d is None or is_number(d) and d >= 0 for d in draft)):
            raise ValueError(f"state field costs.draft: expected {len(self.draft)} numbers or nulls")
        self.verify.load(verify)
        self.draft = list(draft)
        self.draft_weight = [0.0 if d is None else self.LOADED_WEIGHT for d in draft]


class AcceptanceByPosition:
    """Per arm and draft position m (1-based), a smoothed estimate of a_i(m).

    Position m is shrunk toward position m - 1 (position 1 toward `prior`): a position never
    drafted yet is expected to do as well as the one before it. A fixed prior there would
    stop the draft length from ever growing past what was tried: a drafter accepted 80% of
    the time at position 3 would be judged 50% at position 4 for ever, never drafted there,
    never measured."""

    def __init__(self, arms: int, k_max: int, prior: float = 0.5, prior_weight: float = 1.0, decay: float = 0.98):
        self.k_max, self.decay = k_max, decay
        self.prior, self.prior_weight = prior, prior_weight
        self.hits = [[0.0] * k_max for _ in range(arms)]
        self.seen = [[0.0] * k_max for _ in range(arms)]

    def observe(self, arm: int, alignment: Sequence[float], first: int = 1) -> None:
        """`alignment[m - first]`: acceptance probability of position m given the earlier ones
        were accepted; only positions up to the first (certain) rejection are conditional ones."""
        for m, value in enumerate(alignment[: max(0, self.k_max - first + 1)], start=first - 1):
            value = probability(value)  # a NaN model's alignment is a rejection
            self.hits[arm][m] = self.decay * self.hits[arm][m] + value
            self.seen[arm][m] = self.decay * self.seen[arm][m] + 1
            if value == 0.0:
                break

    def rates(self, arm: int, k: int, rng: random.Random | None = None) -> list[float]:
        """a_i(1) .. a_i(k): posterior means, or with `rng` one draw from each position's
        posterior (Thompson sampling), each position's prior centred on the draw before it.

        Planning K on draws keeps deep positions explored: a position is measured only
        when a round drafts that deep, so one early rejection there would otherwise hold
        its mean down, keep every plan short of it and never be corrected. Where evidence
        is plentiful the draws stay close to the mean."""
        out, anchor, w = [], self.prior, self.prior_weight
        hits, seen = self.hits[arm], self.seen[arm]
        for m in range(k):
            if rng is None:
                anchor = (hits[m] + w * anchor) / (seen[m] + w)
            else:
                alpha = hits[m] + w * anchor
                beta = max(0.0, seen[m] - hits[m]) + w * (1.0 - anchor)
                # betavariate never returns on a NaN parameter: anything not finite is the mean
                anchor = rng.betavariate(alpha + 1e-6, beta + 1e-6) if math.isfinite(alpha + beta) else anchor
            out.append(anchor)
        return out

    def carried_over(self, rounds: float) -> "AcceptanceByPosition":
        """A fresh estimate for the next prompt that starts from this one's rates, worth at
        most `rounds` observations per position: a pair's acceptance by position changes
        from prompt to prompt, but far less than a flat prior says, and a prompt that starts
        from 0.5 plans short or plain rounds until its own evidence outweighs the prior."""
        fresh = AcceptanceByPosition(len(self.hits), self.k_max, self.prior, self.prior_weight, self.decay)
        for arm, (hits, seen) in enumerate(zip(self.hits, self.seen)):
            for m, count in enumerate(seen):
                scale = min(1.0, rounds / count) if count > 0 else 0.0
                fresh.hits[arm][m], fresh.seen[arm][m] = hits[m] * scale, count * scale
        return fresh

    def state(self) -> dict:
        return {"hits": [list(row) for row in self.hits], "seen": [list(row) for row in self.seen]}

    def load(self, state: dict, field: str = "acceptance") -> None:
        """`state` as `state()` wrote it; ValueError naming the state's `field` on garbage."""
        if not isinstance(state, dict):
            raise ValueError(f"state field {field}: expected an object with hits and seen")
        for key in ("hits", "seen"):
            rows = state.get(key)
            if not (isinstance(rows, list) and len(rows) == len(self.hits)
                    and all(isinstance(r, list) and len(r) == self.k_max and all(is_number(v) for v in r)
                            for r in rows)):
                raise ValueError(f"state field {field}.{key}: expected {len(self.hits)} lists of {self.k_max} numbers")
        for hits, seen in zip(state["hits"], state["seen"]):
            if any(h < 0 or h > s + 1e-9 for h, s in zip(hits, seen)):
                raise ValueError(f"state field {field}: hits must be counts from 0 to seen")
        self.hits = [[float(v) for v in row] for row in state["hits"]]
        self.seen = [[float(v) for v in row] for row in state["seen"]]

    def expected_committed(self, arm: int, k: int) -> float:
        return self.committed_by_length(arm, k)[k]

    def committed_by_length(self, arm: int, k: int) -> list[float]:
        """E[committed tokens] of a round drafting K = 0 .. k tokens."""
        return committed_by_length(self.rates(arm, k))


def committed_by_length(rates: Sequence[float]) -> list[float]:
    """E[committed tokens] of a round drafting K = 0 .. len(rates) tokens whose position m
    is accepted with probability rates[m - 1] once the ones before it were."""
    out, total, survive = [1.0], 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
        out.append(total)
    return out


def best_draft_length(expected: Sequence[float], seconds: Sequence[float]) -> int:
    """argmax_K expected[K] / seconds[K] over K = 0 .. len - 1 (the shortest on ties)."""
    best, best_rate = 0, -1.0
    for k, (tokens, cost) in enumerate(zip(expected, seconds)):
        rate = tokens / cost if cost > 0 else float("inf")
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


def is_number(value: object) -> bool:
    """A finite JSON number (not a bool) read back from a state file: Python's JSON reads
    NaN and Infinity, and a NaN count would make every later plan NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
