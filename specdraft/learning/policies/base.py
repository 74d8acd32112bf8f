"""The policy interface: what the decode core tells a policy and what it asks of it.

Policies are plain Python (no torch): `select()` returns the index of the arm for the next
round, `update(feedback)` learns from the round's alignment feedback. Each policy declares
its options (name -> OptionSpec) and checks them itself (`check_options` returns problems;
the profile adds key paths), so a `[policy]` table is validated before any model loads;
options every policy shares (reset, evaluate, objective, allow_none, draft_length) are
declared once (options.py), and exposed as properties so callers never dig in `options`.

Speed is the objective here, for every policy alike (ARCHITECTURE.md, "Goodput"): each
policy owns a round cost model and each arm's acceptance by position, plans every round's
draft length from them, and with `objective = "goodput"` (the default) its rewards and
losses are estimated speedups over plain decoding rather than accepted tokens.
"""

from __future__ import annotations

import copy
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from specdraft.learning.confidence import StopRule
from specdraft.learning.feedback import RoundFeedback, bd_reward, be_reward, expected_accept_length
from specdraft.learning.goodput import AcceptanceByPosition, RoundCostModel, best_draft_length, committed_by_length
from specdraft.learning.policies.options import COMMON_OPTIONS, OptionSpec, one_of, scaled  # noqa: F401 (re-exported)
from specdraft.learning.policies.state_json import jsonable, restored

PLAIN_ARM = "none"  # the arm that drafts nothing: a plain decoding round


@dataclass(frozen=True)
class RoundPlan:
    """What the policy decided for one round, and what it expects of it."""

    arm: int
    draft_tokens: int  # K for this round (0 = a plain decoding round)
    # Early stop: when one more draft token stops paying for its time; None before costs
    # are known, and with draft_length = "fixed".
    stop: StopRule | None = None
    expected_tokens: float | None = None  # E[committed | arm, K]
    expected_seconds: float | None = None  # T(arm, K)


class Policy(ABC):
    """Chooses one arm (drafter index) per round."""

    name: ClassVar[str]
    OPTIONS: ClassVar[dict[str, OptionSpec]] = {}
    FULL_INFORMATION: ClassVar[bool] = False  # needs evaluate = "all"
    STATE: ClassVar[tuple[str, ...]] = ()  # attributes that hold what was learned, saved as JSON
    REPROBE: ClassVar[int] = 8
    # Rounds that what earlier prompts taught is worth to the next one: acceptance by
    # position always, the learner's own state under reset = "carry".
    CARRIED_ROUNDS: ClassVar[float] = 4.0
    MAX_PROBE_GAP: ClassVar[int] = 256

    def __init__(self, arms: Sequence[str], options: dict[str, Any] | None = None, seed: int | None = None,
                 draft_tokens: int = 5, horizon: int = 256):
        if not arms:
            raise ValueError("a policy needs at least one arm")
        self.arms = list(arms)
        self.options = {k: spec.default for k, spec in self.all_options().items()} | dict(options or {})
        self.draft_tokens = draft_tokens
        self.horizon = horizon
        self.rng = random.Random(seed)
        # Draft-length exploration draws from its own stream: arm choices stay as they were.
        self._length_rng = random.Random(None if seed is None else seed + 1)
        self.goodput = self.options["objective"] == "goodput"
        self._initial_state: dict | None = None
        self.reset()

    @classmethod
    def all_options(cls) -> dict[str, OptionSpec]:
        return {**COMMON_OPTIONS, **cls.OPTIONS}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], drafters: Sequence[str]) -> list[tuple[str, str]]:
        """Problems with `options` for a pool of `drafters`, as (option, message) pairs."""
        specs, problems = cls.all_options(), []
        for opt, value in options.items():
            spec = specs.get(opt)
            if spec is None:
                problems.append((opt, f'unknown option for policy "{cls.name}"; its options: {", ".join(specs)}'))
            elif (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
                expected = " or ".join(t.__name__ for t in spec.types)
                problems.append((opt, f"expected {expected}, got {type(value).__name__}"))
            elif not spec.check(value):
                problems.append((opt, f"{spec.requirement} (got {value!r})"))
        if problems:
            return problems
        if cls.FULL_INFORMATION and options.get("evaluate", specs["evaluate"].default) != "all":
            problems.append(("evaluate", f'policy "{cls.name}" learns from every drafter each round: set evaluate = "all"'))
        drafter = options.get("drafter")
        with_none = options.get("allow_none", specs["allow_none"].default)
        if drafter is not None and drafter not in drafters and not (drafter == PLAIN_ARM and with_none):
            problems.append(("drafter", f'no drafter named "{drafter}"; the pool has {", ".join(drafters)}'))
        return problems

    # --- what callers need to know about how this policy is driven -------------------------

    @property
    def full_information(self) -> bool:
        """Every drafter is scored on the verified text each round (evaluate = "all")."""
        return self.options["evaluate"] == "all"

    @property
    def resets_per_prompt(self) -> bool:
        """reset() runs before each prompt (to forget, or to carry over a prior)."""
        return self.options["reset"] in ("prompt", "carry")

    @property
    def forgets_per_prompt(self) -> bool:
        """Nothing the learner learns now reaches the next prompt."""
        return self.options["reset"] == "prompt"

    @property
    def allows_none(self) -> bool:
        """The pool gets a "none" arm: plain decoding for a round."""
        return bool(self.options["allow_none"])

    def reset(self) -> None:
        """Forget what was learned, or under reset = "carry" keep it scaled down to a few
        rounds' worth (before each prompt unless reset = "never"); a loaded state is where
        every reset starts from. The round cost model is kept: it describes
        this machine and these models, not the prompt (so no prompt pays to measure it again)."""
        if not hasattr(self, "costs"):
            self.costs = RoundCostModel(len(self.arms))
        # Acceptance by position (what plans K) starts from the earlier prompts' rates,
        # worth a few rounds; what the learner itself knows (its choice of arm) starts over.
        previous = getattr(self, "acceptance", None)
        self.acceptance = (AcceptanceByPosition(len(self.arms), self.draft_tokens) if previous is None
                           else previous.carried_over(self.CARRIED_ROUNDS))
        self._idle = [0] * len(self.arms)  # rounds each arm was planned at K = 0 since its last draft
        self._probe_gap = [self.REPROBE] * len(self.arms)
        # Under reset = "carry" the learner's state carries over too, scaled down to at most
        # CARRIED_ROUNDS rounds of evidence (learned_rounds: what the state holds).
        rounds = getattr(self, "learned_rounds", 0.0) if self.options["reset"] == "carry" else 0.0
        factor = min(1.0, self.CARRIED_ROUNDS / rounds) if rounds > 0 else 0.0
        snapshot = {key: copy.deepcopy(getattr(self, key)) for key in self.STATE} if factor else None
        self.fresh()
        self.learned_rounds = rounds * factor
        if self._initial_state is not None:
            self._apply_state(self._initial_state)
        if snapshot is not None:
            self.carry_in(snapshot, factor)

    def carry_in(self, snapshot: dict, factor: float) -> None:
        """Start a prompt from an earlier prompt's learner state `snapshot` (STATE keys),
        its evidence scaled by `factor` in (0, 1]: a prior the new prompt can overturn in a
        few rounds. Policies whose state is evidence override this; by default the learner
        starts fresh (it learns nothing that carries, as fixed and random)."""

    def fresh(self) -> None:
        """Set up the learner's state from scratch; policies that learn override this."""

    @abstractmethod
    def select(self, awake: Sequence[bool] | None = None) -> int:
        """The arm for the next round. `awake[i]` is False for a drafter that would propose
        nothing here (prompt lookup without a match): a learner picks among the awake arms
        (sleeping experts), so a silent favourite hands the round to the next best arm
        instead of wasting it on a plain round. None: every arm is awake."""

    def awake_arms(self, awake: Sequence[bool] | None) -> list[int]:
        """Indices of the awake arms (all of them when `awake` is None or none is awake)."""
        arms = [i for i in range(len(self.arms)) if awake is None or awake[i]]
        return arms or list(range(len(self.arms)))

    @property
    def chooses_by_context(self) -> bool:
        """Whether `select` uses the awake mask (the engine skips computing it otherwise)."""
        return True

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round: its costs and acceptance first (rewards are built on them)."""
        self.observe(feedback)
        self.learn(feedback)
        self.learned_rounds += 1

    def observe(self, feedback: RoundFeedback) -> None:
        """Only the round's timings and the chosen drafter's acceptance: what every round
        teaches, also one that full-information evaluation skipped."""
        self.costs.observe(feedback.arm, feedback.drafted, feedback.draft_seconds, feedback.verify_seconds,
                           feedback.verify_width)
        if feedback.gammas is not None:  # every arm's acceptance along the committed chunk
            for arm, gammas in enumerate(feedback.gammas):
                # A drafter silent here would not have drafted: its acceptance *when it
                # drafts*, which plans K, learns nothing from this chunk.
                if self.arms[arm] != PLAIN_ARM and not (feedback.silent and feedback.silent[arm]):
                    self.acceptance.observe(arm, gammas)
        else:
            self.acceptance.observe(feedback.arm, feedback.alphas)

    def learn(self, feedback: RoundFeedback) -> None:
        """Policy-specific learning; the default learns nothing."""

    def evaluation_interval(self) -> int:
        """With full-information evaluation: how many rounds the engine may batch before
        evaluating the drafters and passing the feedback on (1 = every round)."""
        return 1

    @property
    def evaluation_sampled(self) -> bool:
        """True: evaluate one round in `evaluation_interval()` and skip the others (they
        teach costs and the chosen arm's acceptance only); False: batch them all."""
        return False

    def after_evaluation(self) -> None:
        """Called once a batch of evaluated rounds was learned from (may adapt the interval)."""

    def scores(self) -> dict[str, float] | None:
        """Per-arm weight or index for the live panel, or None when the policy has none."""
        return None

    # --- planning a round ---------------------------------------------------------------

    def plan(self, cap: int, awake: Sequence[bool] | None = None) -> RoundPlan:
        """The arm for the next round (among the `awake` ones), its draft length (at most
        `cap`) and what is expected."""
        arm = self.select(awake)
        # One posterior draw of the arm's acceptance by position plans both K and how far
        # the early stop looks ahead (Thompson sampling: see AcceptanceByPosition.rates),
        # so a plan that explores deeper is not cut back by the means it set out to test.
        rates = self._drawn_rates(arm, cap)
        k = self.draft_length(arm, cap, rates)
        expected, seconds = self.estimate(arm, k)
        return RoundPlan(arm, k, self.stop_rule(arm, k, expected, seconds, rates, horizon=cap), expected, seconds)

    def stop_rule(self, arm: int, k: int, expected: float, seconds: float | None,
                  rates: Sequence[float] | None = None, horizon: int | None = None) -> StopRule | None:
        """When a draft planned at `k` tokens from `arm` stops (None with draft_length =
        "fixed", where every round drafts K tokens, or while costs are unknown). It looks
        ahead with `rates` (the plan's draw), else the arm's mean acceptance by position,
        up to `horizon` >= k tokens: a drafter whose tokens are surer than the plan
        expected may draft past k while the longer round is expected to pay off (the plan
        judged K on average acceptance; the drafter sees each token's own confidence)."""
        if self.options["draft_length"] != "goodput" or not seconds or k == 0:
            return None
        horizon = max(k, horizon or k)
        by_length = [self.costs.round_seconds(arm, j) for j in range(horizon + 1)]
        per_token = self.costs.token_seconds(arm, k)
        if per_token is None or any(t is None or t <= 0 for t in by_length):
            return None
        ahead = list(rates[:horizon]) if rates is not None else self.acceptance.rates(arm, horizon)
        return StopRule(by_length, ahead, expected / seconds * per_token)

    def draft_length(self, arm: int, cap: int, rates: Sequence[float] | None = None) -> int:
        """How many tokens `arm` drafts this round, at most `cap`: always `cap` with
        draft_length = "fixed"; with "goodput", the K in 0..cap with the best estimated
        tokens per second (one token until the arm's draft cost is known: one token
        measures it, and a slow drafter's probe must not cost K of its forwards)."""
        best = self.best_length(arm, cap, rates if rates is not None else self._drawn_rates(arm, cap))
        if (self.options["draft_length"] != "goodput" or self.arms[arm] == PLAIN_ARM or cap == 0
                or self.full_information):
            return best
        # Under bandit feedback a drafter planned at K = 0 teaches nothing about its
        # acceptance (full information scores it anyway), so after REPROBE such rounds it
        # drafts one token; each probe that changes nothing doubles the wait (a slow
        # drafter's probes must not add up), and drafting again resets it.
        if best > 0:
            self._idle[arm], self._probe_gap[arm] = 0, self.REPROBE
            return best
        self._idle[arm] += 1
        if self._idle[arm] < self._probe_gap[arm]:
            return 0
        self._idle[arm], self._probe_gap[arm] = 0, min(2 * self._probe_gap[arm], self.MAX_PROBE_GAP)
        return 1

    def _drawn_rates(self, arm: int, cap: int) -> list[float] | None:
        """One posterior draw of `arm`'s acceptance at positions 1 .. cap, where the draft
        length is planned from acceptance (None for the plain arm and fixed lengths)."""
        if self.options["draft_length"] != "goodput" or self.arms[arm] == PLAIN_ARM:
            return None
        return self.acceptance.rates(arm, cap, self._length_rng)

    def best_length(self, arm: int, cap: int, rates: Sequence[float] | None = None) -> int:
        """The draft length the estimates favour for `arm`: under `rates` (a posterior draw
        of its acceptance by position, so that deep positions unlucky once are tried
        again), else under the means (no side effects)."""
        if self.arms[arm] == PLAIN_ARM:
            return 0
        if self.options["draft_length"] != "goodput" or cap == 0:
            return cap
        seconds = [self.costs.round_seconds(arm, k) for k in range(cap + 1)]
        if any(s is None for s in seconds):
            return 1
        committed = (self.acceptance.committed_by_length(arm, cap) if rates is None
                     else committed_by_length(rates[:cap]))
        return best_draft_length(committed, seconds)

    def estimate(self, arm: int, k: int) -> tuple[float, float | None]:
        """(E[committed | arm, k], T(arm, k) or None while unknown)."""
        return self.acceptance.expected_committed(arm, k), self.costs.round_seconds(arm, k)

    def speedup(self, arm: int, expected_tokens: float, k: int) -> float | None:
        """Estimated speedup over plain decoding of a round of `arm` drafting `k` tokens that
        commits `expected_tokens`: (tokens / T(arm, k)) / (1 / T(plain)); None while unknown."""
        seconds, plain = self.costs.round_seconds(arm, k), self.costs.round_seconds(arm, 0)
        if seconds is None or plain is None or seconds <= 0:
            return None
        return expected_tokens / seconds * plain

    def estimated_value(self, arm: int) -> float:
        """What `arm` is expected to give in this policy's units, at its best draft length:
        with the goodput objective its estimated speedup over plain decoding (0 while
        unknown), else its expected committed tokens. Learners break ties with it."""
        k = self.best_length(arm, self.draft_tokens)
        expected = self.acceptance.expected_committed(arm, k)
        return (self.speedup(arm, expected, k) or 0.0) if self.goodput else expected

    def ceiling(self, arm: int) -> float | None:
        """`arm`'s estimated speedup if every token it drafted were accepted, at the best
        draft length for that (None while its costs are unknown): no acceptance could take
        it past this, so its draft cost alone decides it."""
        values = [self.speedup(arm, k + 1.0, k) for k in range(1, self.draft_tokens + 1)]
        return None if not values or any(v is None for v in values) else max(values)

    def evaluation_skips(self) -> list[bool]:
        """Per arm: not worth scoring now. With the goodput objective, a drafter whose
        ceiling is below the leading arm's estimated speedup cannot be the fastest choice
        whatever its acceptance, so full-information evaluation skips it (its regret does
        not move: it is asleep for the round) until the leader's estimate falls to its
        ceiling. On a CPU this spares the scoring of self-drafters whose every draft token
        costs most of a target forward."""
        if not self.goodput or self.options["draft_length"] != "goodput":
            return [False] * len(self.arms)
        leader = max(self.estimated_value(i) for i in range(len(self.arms)))
        out = []
        for arm, name in enumerate(self.arms):
            ceiling = None if name == PLAIN_ARM else self.ceiling(arm)
            out.append(ceiling is not None and ceiling < leader)
        return out

    def ideal_speedup(self) -> tuple[int, int, float] | None:
        """(arm, K, speedup) of the best arm at its best K by the current estimates:
        `G(best i, best K) * c_verify(1)`, the limit of what this pool can give."""
        best = None
        for arm in range(len(self.arms)):
            k = self.best_length(arm, self.draft_tokens)
            value = self.speedup(arm, self.acceptance.expected_committed(arm, k), k)
            if value is not None and (best is None or value > best[2]):
                best = (arm, k, value)
        return best

    # --- what a round was worth, in the units this policy was asked to optimise -------------

    def chosen_reward(self, fb: RoundFeedback, kind: str = "bd") -> float:
        """Bandit reward in [0, 1] for the chosen arm: BD or BE, or with the goodput
        objective the round's estimated speedup over plain decoding, over K + 1."""
        if not self.goodput:
            return be_reward(fb.accepted, fb.drafted) if kind == "be" else bd_reward(fb.alphas)
        expected = fb.accepted + 1 if kind == "be" else expected_accept_length(fb.alphas)
        return self.speed_score(fb.arm, expected, fb.drafted)

    def speed_score(self, arm: int, expected_tokens: float, k: int) -> float:
        """Estimated speedup over plain decoding scaled into [0, 1] by the most a round can
        commit (K + 1); tokens over K + 1 while costs are unknown."""
        value = self.speedup(arm, expected_tokens, k)
        if value is None:
            value = expected_tokens
        return min(1.0, value / (self.draft_tokens + 1))

    def cost_probe(self, awake: Sequence[bool] | None = None) -> int | None:
        """With the goodput objective, an awake arm that never drafted yet (try it once: its
        draft cost is unknown until then)."""
        if not self.goodput:
            return None
        return next((i for i in self.awake_arms(awake) if self.costs.draft[i] is None and self.arms[i] != PLAIN_ARM),
                    None)

    # --- persistence --------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {key: jsonable(getattr(self, key)) for key in self.STATE}
        state["costs"] = self.costs.state()
        state["acceptance"] = self.acceptance.state()
        return {"policy": self.name, "arms": self.arms, "state": state}

    def load_state_dict(self, saved: dict) -> None:
        """Start every later reset from `saved` (as written by state_dict)."""
        if saved.get("policy") != self.name or saved.get("arms") != self.arms:
            raise ValueError(
                f"saved state is for policy {saved.get('policy')!r} with arms {saved.get('arms')}, "
                f"not {self.name!r} with {self.arms}"
            )
        state = saved.get("state")
        if not isinstance(state, dict):
            raise ValueError('saved state has no "state" object')
        # A private copy: learning must never write into the caller's dict, and every
        # reset must start from exactly what was saved.
        candidate = copy.deepcopy(state)
        try:
            self.fresh()
            self._apply_state(candidate)  # raises on garbage before anything is kept
        except ValueError:
            self.reset()
            raise
        self._initial_state = candidate
        self.learned_rounds = 0.0  # the loaded state is the start: nothing earlier is carried into it
        self.reset()

    def _apply_state(self, state: dict) -> None:
        for key in self.STATE:
            if key in state:
                setattr(self, key, restored(key, getattr(self, key), copy.deepcopy(state[key])))
        if isinstance(state.get("costs"), list):
            state = {k: v for k, v in state.items() if k != "costs"}  # 0.x files: per-arm seconds, superseded
        if "costs" in state:
            if not isinstance(state["costs"], dict):
                raise ValueError("state field costs: expected an object")
            self.costs.load(state["costs"])
        if "acceptance" in state:
            if not isinstance(state["acceptance"], dict):
                raise ValueError("state field acceptance: expected an object")
            self.acceptance.load(state["acceptance"])

