"""Speed as the objective (ARCHITECTURE.md, "Goodput"): an online round cost model, each
drafter's acceptance by draft position, and the draft length that maximises goodput.

- Round cost `T(i, K) = c_verify(K + 1) + K * c_draft(i)`: verify cost as fixed +
  per-verified-token (a line fitted to this run's verify timings, recent rounds weighing
  more), draft cost per token per drafter (a moving average).
- Acceptance by position `a_i(m)` = P(position m accepted | positions before it accepted),
  from the chosen drafter's alignment up to its first rejection and, under full
  information, from every drafter's gammas along the committed chunk.
- Goodput `G(i, K) = E[committed | i, K] / T(i, K)` with
  `E[committed | i, K] = 1 + sum_{j<=K} prod_{m<=j} a_i(m)`; K = 0 is plain decoding.
Plain Python: no torch.
"""

from __future__ import annotations

from typing import Sequence


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

    def slope(self) -> float:
        """Seconds per extra token (0 until two widths were seen)."""
        one, two = self(1), self(2)
        return 0.0 if one is None or two is None else two - one

    def state(self) -> list[float]:
        return [self.w, self.sx, self.sy, self.sxx, self.sxy]

    def load(self, values: list[float]) -> None:
        self.w, self.sx, self.sy, self.sxx, self.sxy = (float(v) for v in values)


class RoundCostModel:
    """Seconds a round takes: `T(arm, K) = c_verify(K + 1) + K * c_draft(arm)`."""

    def __init__(self, arms: int, decay: float = 0.95):
        self.verify = _DecayedLine(decay)
        self.draft: list[float | None] = [None] * arms  # seconds per drafted token
        self.decay = decay

    def observe(self, arm: int, drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.verify.add(drafted + 1, verify_seconds)
        if drafted:
            per_token = draft_seconds / drafted
            old = self.draft[arm]
            self.draft[arm] = per_token if old is None else self.decay * old + (1 - self.decay) * per_token

    def round_seconds(self, arm: int, k: int) -> float | None:
        """Estimated T(arm, k), or None before any verify was timed or, for k > 0, before the
        arm ever drafted."""
        verify = self.verify(k + 1)
        if verify is None or (k > 0 and self.draft[arm] is None):
            return None
        return verify + k * (self.draft[arm] or 0.0)

    def token_seconds(self, arm: int) -> float | None:
        """What one more drafted token adds to the round: its draft plus its share of the verify."""
        draft = self.draft[arm]
        return None if draft is None else draft + self.verify.slope()

    def state(self) -> dict:
        return {"verify": self.verify.state(), "draft": list(self.draft)}

    def load(self, state: dict) -> None:
        verify, draft = state.get("verify"), state.get("draft")
        if not (isinstance(verify, list) and len(verify) == 5 and all(_is_number(v) for v in verify)):
            raise ValueError("state field costs.verify: expected 5 numbers")
        if not (isinstance(draft, list) and len(draft) == len(self.draft)
                and all(d is None or _is_number(d) for d in draft)):
            raise ValueError(f"state field costs.draft: expected {len(self.draft)} numbers or nulls")
        self.verify.load(verify)
        self.draft = list(draft)


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

    def observe(self, arm: int, alignment: Sequence[float]) -> None:
        """`alignment[m - 1]`: acceptance probability of position m given the earlier ones were
        accepted; only positions up to the first (certain) rejection are conditional ones."""
        for m, value in enumerate(alignment[: self.k_max]):
            self.hits[arm][m] = self.decay * self.hits[arm][m] + value
            self.seen[arm][m] = self.decay * self.seen[arm][m] + 1
            if value == 0.0:
                break

    def rates(self, arm: int, k: int) -> list[float]:
        """a_i(1) .. a_i(k)."""
        out, anchor, w = [], self.prior, self.prior_weight
        hits, seen = self.hits[arm], self.seen[arm]
        for m in range(k):
            anchor = (hits[m] + w * anchor) / (seen[m] + w)
            out.append(anchor)
        return out

    def rate(self, arm: int, position: int) -> float:
        return self.rates(arm, position)[-1]

    def state(self) -> dict:
        return {"hits": [list(row) for row in self.hits], "seen": [list(row) for row in self.seen]}

    def load(self, state: dict) -> None:
        for key in ("hits", "seen"):
            rows = state.get(key)
            if not (isinstance(rows, list) and len(rows) == len(self.hits)
                    and all(isinstance(r, list) and len(r) == self.k_max and all(_is_number(v) for v in r)
                            for r in rows)):
                raise ValueError(f"state field acceptance.{key}: expected {len(self.hits)} lists of {self.k_max} numbers")
        self.hits = [[float(v) for v in row] for row in state["hits"]]
        self.seen = [[float(v) for v in row] for row in state["seen"]]

    def expected_committed(self, arm: int, k: int) -> float:
        return self.committed_by_length(arm, k)[k]

    def committed_by_length(self, arm: int, k: int) -> list[float]:
        """E[committed tokens] of a round drafting K = 0 .. k tokens."""
        out, total, survive = [1.0], 1.0, 1.0
        for rate in self.rates(arm, k):
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
