"""HedgeSpec's full-information learners: every drafter is scored counterfactually on the
verified text every round, so no exploration is needed.

- `normalhedge` (HedgeSpec's default, Chaudhuri et al. 2009; HedgeSpec Fig. 7).
- `hedge`: exponential weights with learning rate eta.
- `adanormalhedge` (Luo & Schapire 2015).

Losses (options): `loss = "length"` (1 - EAL / (K + 1), default) or `"acceptance"`
(mean 1 - gamma); `hybrid_rounds` uses the acceptance loss for the first rounds (the
"hybrid" warm-up of appendix B.5); `update_every = m`, after `warmup_rounds`, has the
engine evaluate the drafters once every m rounds, in one forward per drafter over all m
chunks, and apply the m loss vectors together (the "skip" trick, which is what makes
full-information evaluation affordable when drafters are not tiny); `"adaptive"` (the
default) evaluates one round in m, skipping the others (they teach costs and the chosen
drafter's acceptance only), doubling m up to 16 each time an evaluation confirms the same
leader (the heaviest arm) and dropping back to 1 when the leader changes. With the goodput objective a
drafter's loss is 1 - its estimated speedup at its own best K, over K + 1. `game = "chunk"` scores each round's chunk
(positions beyond it are censored); `game = "token"` plays one game per committed token
with delayed feedback: a token's loss is applied once the K positions after it are
verified (QFI-D queue, appendix B.1).
"""

from __future__ import annotations

import math
from typing import Sequence

from specdraft.learning.feedback import RoundFeedback, acceptance_loss, expected_accept_length, length_loss
from specdraft.learning.policies.base import OptionSpec, Policy, one_of, scaled
from specdraft.learning.policies.objective import judged_length, speed_score

HEDGE_OPTIONS = {
    "evaluate": OptionSpec((str,), "all", one_of("all"), 'must be "all": these learners score every drafter'),
    "loss": OptionSpec((str,), "length", one_of("length", "acceptance"), 'must be "length" or "acceptance"'),
    "game": OptionSpec((str,), "chunk", one_of("chunk", "token"), 'must be "chunk" or "token"'),
    "hybrid_rounds": OptionSpec((int,), 0, lambda v: v >= 0, "must be >= 0",
                                "rounds that use the acceptance loss before the length loss"),
    "warmup_rounds": OptionSpec((int,), 0, lambda v: v >= 0, "must be >= 0",
                                "rounds evaluated one by one before update_every applies"),
    "update_every": OptionSpec((int, str), "adaptive", lambda v: v == "adaptive" or (isinstance(v, int) and v >= 1),
                               'must be >= 1 or "adaptive"',
                               "evaluate drafters and update once every m rounds (batched), or adapt m"),
    # With full information nothing needs exploring, so the heaviest arm is the fastest
    # choice; "sample" is the papers' randomised play (and its regret guarantee).
    "select": OptionSpec((str,), "argmax", one_of("sample", "argmax"), 'must be "sample" or "argmax"',
                         "take the heaviest drafter, or draw it from the weights"),
}


class HedgeFamily(Policy):
    FULL_INFORMATION = True
    STATE = ("weights_state", "rounds")
    COUNTS = ("rounds",)
    MAX_INTERVAL = 16

    def fresh(self) -> None:
        self.rounds = 0
        self.interval, self.leader = 1, -1  # adaptive evaluation interval
        self.history: list[list[float]] = []  # token game: per-arm gammas at every committed position
        self.scored_until = 0  # token game: positions whose loss was already produced
        self.weights_state = self.initial_weights_state()

    def carry_in(self, snapshot: dict, factor: float) -> None:
        # Regrets (or cumulative losses) scaled down: the same leader, overturned by a few
        # rounds of evidence against it rather than by a whole prompt's.
        self.weights_state = scaled(snapshot["weights_state"], factor)

    # Subclasses: their learned state, how losses move it, and the distribution it implies.
    def initial_weights_state(self) -> list: ...

    def apply(self, losses: list[float]) -> None: ...

    def distribution(self) -> list[float]: ...

    def select(self, awake: Sequence[bool] | None = None) -> int:
        # Sleeping experts: only drafters that would propose something here compete.
        probe = self.planner.cost_probe(awake)
        if probe is not None:
            return probe
        p, arms = self.distribution(), self.awake_arms(awake)
        if self.options["select"] == "argmax":
            # NormalHedge gives every arm without positive regret weight 0: among equal
            # weights, the arm the estimates favour (not the first listed).
            top = max(p[i] for i in arms)
            tied = [i for i in arms if p[i] >= top - 1e-12]
            return tied[0] if len(tied) == 1 else max(tied, key=self.planner.estimated_value)
        return self.rng.choices(arms, weights=[p[i] for i in arms])[0]

    def learn(self, fb: RoundFeedback) -> None:
        if fb.gammas is None:
            raise ValueError(f'policy "{self.name}" needs full-information feedback (evaluate = "all")')
        self.rounds += 1
        for losses in self._losses(fb):
            self.apply(losses)

    def evaluation_interval(self) -> int:
        # The "skip" trick: after the warm-up, evaluate and update once every m rounds; the
        # engine batches the m rounds' evaluation into one forward per drafter.
        if self.rounds < self.options["warmup_rounds"]:
            return 1
        every = self.options["update_every"]
        return self.interval if every == "adaptive" else every

    @property
    def evaluation_sampled(self) -> bool:
        # Adaptive: skipped rounds are not scored at all, so evaluation costs shrink with m
        # for every kind (batching m rounds still scores every position).
        return self.options["update_every"] == "adaptive"

    def after_evaluation(self) -> None:
        # Evaluate less often while one arm stays best: the evaluation would only confirm
        # it. A new leader brings evaluation back every round.
        p = self.distribution()
        leader = max(range(len(p)), key=p.__getitem__)
        steady = leader == self.leader
        self.interval = min(2 * self.interval, self.MAX_INTERVAL) if steady else 1
        self.leader = leader

    @property
    def scores_every_arm(self) -> bool:
        return self.options["game"] == "token"  # its delayed losses need every arm's gammas

    def _losses(self, fb: RoundFeedback) -> list[list[float]]:
        k = self.draft_tokens
        acceptance = self.rounds <= self.options["hybrid_rounds"] or self.options["loss"] == "acceptance"
        if self.options["game"] == "chunk":
            losses = [0.0 if g is None else self._loss(i, g[:k], acceptance) for i, g in enumerate(fb.gammas)]
            return [self._asleep_at_learner_loss(losses, fb.silent)]
        # Token game: position t's loss needs gammas at t .. t+K-1; emit those now complete.
        for position in zip(*fb.gammas):
            self.history.append(list(position))
        out = []
        while self.scored_until + k <= len(self.history):
            window = self.history[self.scored_until : self.scored_until + k]
            out.append([self._loss(i, [row[i] for row in window], acceptance) for i in range(len(self.arms))])
            self.scored_until += 1
        return out

    def _asleep_at_learner_loss(self, losses: list[float], silent: Sequence[bool] | None) -> list[float]:
        """Sleeping experts (Freund et al. 1997): a drafter that would have proposed nothing
        at the round's start was never a candidate there (`select` passes over it), so it
        takes the learner's own loss over the awake arms and its regret does not move."""
        if not silent or not any(silent) or all(silent):
            return losses
        p = self.distribution()
        awake = [i for i, quiet in enumerate(silent) if not quiet]
        mass = sum(p[i] for i in awake)
        learner = (sum(p[i] * losses[i] for i in awake) / mass if mass > 0
                   else sum(losses[i] for i in awake) / len(awake))
        return [learner if quiet else loss for loss, quiet in zip(losses, silent)]

    def _loss(self, arm: int, gammas: list[float], acceptance: bool) -> float:
        if acceptance:
            return acceptance_loss(gammas)
        if not self.goodput:
            return length_loss(gammas, self.draft_tokens)
        # The chunk is as long as the chosen arm's round committed: positions past it are
        # censored, so a drafter is judged at the draft length the chunk can show (else a
        # cheap arm would lock the learner in; see judged_length).
        k = judged_length(self.planner, arm, len(gammas))
        return 1.0 - speed_score(self.planner, arm, expected_accept_length(gammas[:k]), k)

    def scores(self) -> dict[str, float]:
        return dict(zip(self.arms, self.distribution()))


class HedgePolicy(HedgeFamily):
    name = "hedge"
    OPTIONS = {**HEDGE_OPTIONS, "eta": OptionSpec((float, int), 2.0, lambda v: v > 0, "must be > 0", "learning rate")}

    def initial_weights_state(self) -> list:
        return [0.0] * len(self.arms)  # cumulative losses

    def apply(self, losses: list[float]) -> None:
        self.weights_state = [c + l for c, l in zip(self.weights_state, losses)]

    def distribution(self) -> list[float]:
        eta, best = self.options["eta"], min(self.weights_state)
        w = [math.exp(-eta * (c - best)) for c in self.weights_state]
        total = sum(w)
        return [x / total for x in w]


def normalhedge_scale(regrets: list[float]) -> float:
    """The c > 0 with mean_i exp([R_i]+^2 / 2c) = e, by bisection on a log scale."""
    positive = [max(r, 0.0) ** 2 for r in regrets]
    top = max(positive)
    if top == 0.0:
        return 1.0

    def excess(c: float) -> float:
        # mean exp(x/2c) - e, computed against the largest term to stay finite
        m = top / (2 * c)
        return math.log(sum(math.exp(x / (2 * c) - m) for x in positive) / len(positive)) + m - 1.0

    lo, hi = top / (2 * (1.0 + math.log(len(positive)))) * 0.5, top  # excess(lo) > 0 > excess(hi)
    while excess(lo) <= 0:
        lo /= 2
    while excess(hi) > 0:
        hi *= 2
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


class NormalHedgePolicy(HedgeFamily):
    name = "normalhedge"
    OPTIONS = HEDGE_OPTIONS

    def initial_weights_state(self) -> list:
        return [0.0] * len(self.arms)  # cumulative regrets R_i

    def apply(self, losses: list[float]) -> None:
        p = self.distribution()
        learner = sum(pi * li for pi, li in zip(p, losses))
        self.weights_state = [r + learner - l for r, l in zip(self.weights_state, losses)]

    _memo: tuple[tuple[float, ...], list[float]] | None = None

    def distribution(self) -> list[float]:
        regrets = self.weights_state
        if max(regrets) <= 0:
            return [1.0 / len(regrets)] * len(regrets)
        # The scale is a root found by bisection, and rounds between updates (every round's
        # choice, a serving engine's many requests) ask again for the same regrets.
        key = tuple(regrets)
        if self._memo is not None and self._memo[0] == key:
            return list(self._memo[1])
        c = normalhedge_scale(regrets)
        top = max(max(r, 0.0) ** 2 for r in regrets) / (2 * c)
        w = [max(r, 0.0) / c * math.exp(max(r, 0.0) ** 2 / (2 * c) - top) for r in regrets]
        total = sum(w)
        self._memo = (key, [x / total for x in w])
        return list(self._memo[1])


class AdaNormalHedgePolicy(HedgeFamily):
    name = "adanormalhedge"
    OPTIONS = HEDGE_OPTIONS

    def initial_weights_state(self) -> list:
        return [[0.0, 0.0] for _ in self.arms]  # per arm: regret R, cumulative |r| C

    @staticmethod
    def _phi(r: float, c: float) -> float:
        return math.exp(max(r, 0.0) ** 2 / (3 * c))

    def _weight(self, r: float, c: float) -> float:
        return max(0.0, 0.5 * (self._phi(r + 1, c + 1) - self._phi(r - 1, c + 1)))

    def apply(self, losses: list[float]) -> None:
        p = self.distribution()
        learner = sum(pi * li for pi, li in zip(p, losses))
        for state, loss in zip(self.weights_state, losses):
            instant = learner - loss
            state[0] += instant
            state[1] += abs(instant)

    def distribution(self) -> list[float]:
        w = [self._weight(r, c) for r, c in self.weights_state]
        total = sum(w)
        if total <= 0 or not math.isfinite(total):
            return [1.0 / len(w)] * len(w)
        return [x / total for x in w]
