"""The policy interface: what the driver asks of a policy, and what it tells it.

A policy selects and learns. `select(awake)` returns the index of the arm for the next round,
`update(feedback)` learns from the round's alignment feedback; `state_dict` and
`load_state_dict` save and load what it learned (as JSON). Everything about planning the
round (draft length, early stop, the cost model, acceptance by position) belongs to the
`RoundPlanner` (learning/planner.py) that the `PolicyDriver` owns; the driver binds it to
the policy (`bind`), which reads its estimates to value rounds in its objective
(`objective.py`) but never changes them.

Each policy declares its options (name -> OptionSpec) and checks them itself
(`check_options` returns problems; the profile adds key paths), so a `[policy]` table is
validated before any model loads; options every policy shares (reset, evaluate, objective,
allow_none, draft_length) are declared once (options.py) and exposed as properties, so
callers never dig in `options`.
"""

from __future__ import annotations

import copy
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.planner import PLAIN_ARM, awake_arms  # noqa: F401 (PLAIN_ARM re-exported)
from specdraft.learning.policies.options import COMMON_OPTIONS, OptionSpec, option_problems, one_of, scaled  # noqa: F401
from specdraft.learning.policies.state_json import jsonable, restored

if TYPE_CHECKING:
    from specdraft.learning.planner import RoundPlanner


class Policy(ABC):
    """Chooses one arm (drafter index) per round."""

    name: ClassVar[str]
    OPTIONS: ClassVar[dict[str, OptionSpec]] = {}
    FULL_INFORMATION: ClassVar[bool] = False  # needs evaluate = "all"
    STATE: ClassVar[tuple[str, ...]] = ()  # attributes that hold what was learned, saved as JSON
    # Of those: counts that cannot be negative, and lists of arm indices (a saved state is
    # checked against both, and a per-arm list must keep one entry per arm).
    COUNTS: ClassVar[tuple[str, ...]] = ()
    ARM_INDICES: ClassVar[tuple[str, ...]] = ()
    # Rounds that what earlier prompts taught is worth to the next one: the planner's
    # acceptance by position always, the learner's own state under reset = "carry".
    CARRIED_ROUNDS: ClassVar[float] = 4.0

    def __init__(self, arms: Sequence[str], options: dict[str, Any] | None = None, seed: int | None = None,
                 draft_tokens: int = 5, horizon: int = 256):
        if not arms:
            raise ValueError("a policy needs at least one arm")
        self.arms = list(arms)
        self.options = {k: spec.default for k, spec in self.all_options().items()} | dict(options or {})
        self.draft_tokens = draft_tokens
        self.horizon = horizon
        self.seed = seed
        self.rng = random.Random(seed)
        self.learned_rounds = 0.0  # rounds of evidence the learner's state holds
        self.initial_state: dict | None = None  # a loaded state: where every reset starts
        self._planner: RoundPlanner | None = None
        self.reset()

    @classmethod
    def all_options(cls) -> dict[str, OptionSpec]:
        return {**COMMON_OPTIONS, **cls.OPTIONS}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], drafters: Sequence[str]) -> list[tuple[str, str]]:
        """Problems with `options` for a pool of `drafters`, as (option, message) pairs."""
        specs = cls.all_options()
        problems = option_problems(specs, options, cls.name)
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
    def goodput(self) -> bool:
        """Rewards and losses are estimated speedups (objective = "goodput"), not accepted tokens."""
        return self.options["objective"] == "goodput"

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
    def chooses_by_context(self) -> bool:
        """Whether `select` uses the awake mask (the engine skips computing it otherwise)."""
        return True

    @property
    def scores_every_arm(self) -> bool:
        """Full-information evaluation must score every arm, even one that cannot be the
        fastest (the planner's `evaluation_skips` are not honoured)."""
        return False

    def bind(self, planner: "RoundPlanner") -> None:
        """Value rounds with `planner`'s estimates: called by the driver that owns it."""
        self._planner = planner

    @property
    def planner(self) -> "RoundPlanner":
        """The planner whose estimates this policy values rounds with (read only)."""
        if self._planner is None:
            raise RuntimeError(f'policy "{self.name}" has no planner: drive it with a PolicyDriver')
        return self._planner

    # --- learning --------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget what was learned, or under reset = "carry" keep it scaled down to at most
        CARRIED_ROUNDS rounds of evidence (before each prompt unless reset = "never"); a
        loaded state is where every reset starts from."""
        rounds = self.learned_rounds if self.options["reset"] == "carry" else 0.0
        factor = min(1.0, self.CARRIED_ROUNDS / rounds) if rounds > 0 else 0.0
        snapshot = {key: copy.deepcopy(getattr(self, key)) for key in self.STATE} if factor else None
        self.fresh()
        self.learned_rounds = rounds * factor
        if self.initial_state is not None:
            self._apply_state(self.initial_state)
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
        return awake_arms(len(self.arms), awake)

    def update(self, feedback: RoundFeedback) -> None:
        """Learn from one round (the driver has taught the planner its costs and acceptance
        first: rewards are built on them)."""
        self.learn(feedback)
        self.learned_rounds += 1

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

    # --- persistence: the learner's state (the driver saves the planner's beside it) --------

    def state_dict(self) -> dict:
        return {"policy": self.name, "arms": self.arms,
                "state": {key: jsonable(getattr(self, key)) for key in self.STATE}}

    def saved_state(self, saved: dict) -> dict:
        """The "state" object of `saved` (as written by a state_dict), a private copy, once
        it is known to be this policy's over these arms; ValueError otherwise."""
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
        return copy.deepcopy(state)

    def load_state_dict(self, saved: dict) -> None:
        """Start every later reset from the learner's fields of `saved` (the STATE keys;
        others are the planner's). Garbage raises ValueError and leaves the policy fresh."""
        candidate = {key: value for key, value in self.saved_state(saved).items() if key in self.STATE}
        try:
            self.fresh()
            self._apply_state(candidate)  # raises on garbage before anything is kept
        except ValueError:
            self.reset()
            raise
        self.initial_state = candidate
        self.learned_rounds = 0.0  # the loaded state is the start: nothing earlier is carried into it
        self.reset()

    def check_loaded(self, state: dict) -> None:
        """A policy whose state has a shape the generic checks do not know checks it here
        (ValueError naming the field)."""

    def _apply_state(self, state: dict) -> None:
        checked = {key: restored(key, getattr(self, key), copy.deepcopy(state[key]))
                   for key in self.STATE if key in state}
        for key, value in checked.items():
            current = getattr(self, key)
            if isinstance(current, list) and len(current) == len(self.arms) and key not in self.ARM_INDICES \
                    and len(value) != len(self.arms):
                raise ValueError(f"state field {key}: expected {len(self.arms)} entries, one per arm")
            if key in self.COUNTS and any(v < 0 for v in _flat(value)):
                raise ValueError(f"state field {key}: counts cannot be negative")
            if key in self.ARM_INDICES and not all(isinstance(v, int) and 0 <= v < len(self.arms) for v in value):
                raise ValueError(f"state field {key}: expected arm numbers from 0 to {len(self.arms) - 1}")
        self.check_loaded(checked)
        for key, value in checked.items():
            setattr(self, key, value)


def _flat(value: Any) -> list:
    if isinstance(value, (list, tuple)) or hasattr(value, "maxlen"):
        return [leaf for item in value for leaf in _flat(item)]
    return [] if value is None else [value]
