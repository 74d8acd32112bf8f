"""Driving a policy through the rounds of one prompt: the one piece of code that live
decoding and offline replay share, so the two cannot drift apart.

The driver owns the round planner (`learning/planner.py`) and binds it to the policy. Per
round the caller asks `choose(produced)` for a RoundPlan: the policy selects the arm, the
planner plans the rest (draft length, early stop, expected tokens and seconds). The caller
runs the round (live: draft and verify; replay: read the trace) and hands the outcome to
`finish_round`. Every round teaches the planner; the driver decides what the policy learns
from and when:
- bandit feedback: the chosen drafter's round, at once;
- full information: the round waits in a queue until the policy's evaluation interval
  is reached (or the prompt ends, unless the policy is about to forget what it would
  learn from them), then an `Evaluator` scores every drafter on all the queued rounds at
  once (live: drafter forwards; replay: the trace's teacher-forced gammas) and the policy
  learns from each round in order; a policy that samples evaluation instead has one round
  in m scored and the others only observed by the planner (timings, the chosen drafter's
  acceptance).
The driver also saves and loads the learned state: the policy's, with the planner's
learned costs and acceptance beside it in the same JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

from specdraft.learning.clock import Clock, host_clock
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.planner import RoundPlanner, plain_arm_of
from specdraft.learning.round_plan import RoundPlan
from specdraft.learning.policies.base import Policy
from specdraft.learning.policies.objective import round_values

Gammas = list[list[float] | None]  # [arm][committed position of the round]; None: not scored


@dataclass(frozen=True)
class RoundOutcome:
    """What a finished round tells the driver."""

    feedback: RoundFeedback  # the chosen drafter's view; gammas filled in by evaluation
    start: int  # committed tokens before the round (prompt included)
    count: int  # tokens the round committed
    evidence: Any = None  # whatever the evaluator needs to score the round (live: the target's p)


class Evaluator(Protocol):
    """Scores the drafters on rounds for a full-information policy (live:
    `decoding/evaluation.PoolEvaluator`; replayed: from a trace)."""

    # Per arm: scored by a forward of its own (the planner scores those only while they may
    # be worth playing); None when the evaluator cannot say.
    costly: Sequence[bool] | None
    # Per arm: scored from the verify's hidden states, which a round hands over only when
    # asked (`PolicyDriver.batch_skips`); None when none is.
    from_hidden: Sequence[bool] | None

    def __call__(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool]) -> list[Gammas]:
        """One Gammas per round, in order, with None for each arm `skip` marks (not scored)."""

    def silent(self, round_: RoundOutcome) -> list[bool] | None:
        """Per arm: would have proposed nothing at the round's start (asleep there); None
        when the evaluator cannot say."""


@dataclass(frozen=True)
class ScoringFunction:
    """An Evaluator that is only its scoring function (`score(rounds, skip)`): no arm known
    costly, none scored from hidden states, sleep not known."""

    score: Callable[[Sequence[RoundOutcome], Sequence[bool]], list[Gammas]]
    costly: Sequence[bool] | None = None
    from_hidden: Sequence[bool] | None = None

    def __call__(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool]) -> list[Gammas]:
        return self.score(rounds, skip)

    def silent(self, round_: RoundOutcome) -> list[bool] | None:
        return None


@dataclass(frozen=True)
class Learned:
    """What `finish_round` did: the rounds evaluated now (chosen arm, gammas), how long the
    evaluation took, and per evaluated round what each arm earned in the policy's objective
    (`objective.round_values`, in `objective.value_unit`; None for an arm not scored or not yet
    priced), valued right after the policy learned from the round: what the regret against
    the best fixed drafter sums."""

    evaluated: list[tuple[int, Gammas]]
    evaluate_s: float = 0.0
    values: list[list[float | None]] = field(default_factory=list)


NOTHING_LEARNED = Learned([])


class PolicyDriver:
    def __init__(self, policy: Policy, draft_tokens: int, max_new_tokens: int, clock: Clock = host_clock):
        self.policy = policy
        # The planner knows arms, K and the shared options, never the policy; the policy
        # reads the planner's estimates (bound here): one direction.
        options = policy.options
        self.planner = RoundPlanner(policy.arms, policy.draft_tokens, plain_arm=plain_arm_of(policy.arms),
                                    objective=options["objective"], draft_length=options["draft_length"],
                                    full_information=policy.full_information, seed=policy.seed,
                                    carried_rounds=policy.CARRIED_ROUNDS, tree=options.get("tree", False),
                                    runner_ups=options.get("runner_ups", True))
        policy.bind(self.planner)
        self.clock = clock  # the target device's: evaluation runs drafters' forwards there
        self.draft_tokens = draft_tokens
        self.max_new_tokens = max_new_tokens
        self.evaluator: Evaluator | None = None
        self.pending: list[RoundOutcome] = []
        self.skipped = 0  # rounds since the last evaluation, when evaluation is sampled
        self._batch_skips: list[bool] | None = None  # `batch_skips`, while rounds are queued

    @property
    def full_information(self) -> bool:
        return self.policy.full_information

    @property
    def wants_runner_ups(self) -> bool:
        """Whether the planner may plan runner-up leaves: then drafters that rank tokens give
        their runner-ups every round, which teach it how often a leaf would pay."""
        return self.planner.tree is not None and self.planner.tree.runner_ups

    def start_prompt(self, evaluator: Evaluator | None = None) -> None:
        """Before each prompt: forget what was learned unless the policy keeps learning
        across prompts; `evaluator` scores drafters when the policy needs full information."""
        if self.policy.full_information and evaluator is None:
            raise ValueError(f'policy "{self.policy.name}" needs an evaluator (evaluate = "all")')
        if self.policy.resets_per_prompt:
            self.policy.reset()
            self.planner.reset()
        self.planner.start_prompt()
        self.evaluator = evaluator
        self.pending = []
        self.skipped = 0
        self._batch_skips = None

    def scored_now(self) -> list[bool]:
        """Per arm: whether an evaluation now would score it (full information): the
        engine prefills the prompt only into the drafters that it would."""
        if self.policy.scores_every_arm:
            return [True] * len(self.policy.arms)
        return [not skip for skip in self.planner.evaluation_skips(self._costly())]

    def batch_skips(self) -> list[bool]:
        """Per arm: left out of the evaluation of the rounds queued from now on (full
        information). Decided when the first of them is chosen and kept until they are
        evaluated (under sampled evaluation, from the first round after an evaluation to
        the next scored one: the rounds between are not scored, and deciding once per
        cycle spares a round's worth of estimates every round): a drafter scored from the
        verify's hidden states (the evaluator's `from_hidden`) needs them handed over by
        every round it is scored on, so the engine asks for them only for arms not skipped
        here, and such an arm is asleep for the choice meanwhile (it could not be scored on
        its own round)."""
        if self._batch_skips is None:
            self._batch_skips = [not scored for scored in self.scored_now()]
        return self._batch_skips

    def _unscorable(self) -> list[bool]:
        """Per arm: scored from hidden states that the queued rounds do not hand over (the
        evaluator then returns no gammas for it)."""
        from_hidden = self.evaluator.from_hidden if self.evaluator is not None else None
        if not from_hidden:
            return [False] * len(self.policy.arms)
        return [hidden and skipped for hidden, skipped in zip(from_hidden, self.batch_skips())]

    def _costly(self) -> Sequence[bool] | None:
        """Per arm: scoring it runs a forward of its own (the evaluator says, when it knows)."""
        return self.evaluator.costly if self.evaluator is not None else None

    @property
    def wants_awake(self) -> bool:
        """Whether `choose` uses an awake mask (which drafters would propose at all)."""
        return self.policy.chooses_by_context

    def choose(self, produced: int, awake: Sequence[bool] | None = None) -> RoundPlan:
        """The plan for the next round after `produced` new tokens, among the `awake` arms.
        Never draft past the budget: a round commits at most draft length + 1 tokens."""
        cap = max(0, min(self.draft_tokens, self.max_new_tokens - produced - 1))
        if not self.pending and not self.skipped:  # the first round of a new batch: its skips are decided now
            self._batch_skips = None
        awake = self._choosable(awake)
        return self.planner.plan(self.policy.select(awake), cap, awake)

    def choose_drafter(self, awake: Sequence[bool] | None = None) -> int:
        """Only the policy's drafter for the next draft, for an engine that sets the draft's
        length itself (a serving engine's batch plan): no round is planned."""
        return self.policy.select(self._choosable(awake))

    def _choosable(self, awake: Sequence[bool] | None) -> Sequence[bool] | None:
        if self.policy.full_information and not self.policy.scores_every_arm:
            # A costly drafter this batch leaves out of evaluation is asleep for the choice
            # too, and so is one whose hidden states this batch does not collect (the batch's
            # decision, not the planner's afresh: weighing every arm's draft lengths each
            # round cost more host time than the rounds it would change).
            skipped, costly = self.batch_skips(), self._costly() or [False] * len(self.policy.arms)
            sits_out = [(c and s) or u for c, s, u in zip(costly, skipped, self._unscorable())]
            if any(sits_out):
                before = awake if awake is not None else [True] * len(sits_out)
                awake = [a and not s for a, s in zip(before, sits_out)]
        return awake

    def verify_width(self, tokens: int) -> int:
        """How many tokens to run a verify of `tokens` over: wider when that is cheaper."""
        return self.planner.verify_width(tokens)

    def learn(self, feedback: RoundFeedback) -> None:
        """One round for the policy to learn from: the planner learns its costs and
        acceptance first (the policy's rewards are built on them)."""
        self.planner.observe(feedback)
        self.policy.update(feedback)

    def finish_round(self, outcome: RoundOutcome, last: bool) -> Learned:
        """Let the policy learn from a finished round; `last` = the prompt ends with it."""
        if not self.policy.full_information:
            self.learn(outcome.feedback)
            return NOTHING_LEARNED
        if last and self.policy.forgets_per_prompt and self.policy.goodput:
            # Nothing would use an evaluation now: the policy forgets what it learned before
            # the next prompt, so scoring the drafters on the prompt's last rounds would only
            # cost time (a model drafter's forward over every token it did not draft). The
            # rounds still teach the costs, which are kept.
            for round_ in [*self.pending, outcome]:
                self.planner.observe(round_.feedback)
            self.pending, self.skipped = [], 0
            return NOTHING_LEARNED
        if self.policy.evaluation_sampled:  # one round in m is scored, the others are skipped
            self.skipped += 1
            if not last and self.skipped < self.policy.evaluation_interval():
                self.planner.observe(outcome.feedback)
                return NOTHING_LEARNED
            self.skipped = 0
            self.pending.append(outcome)  # scored now, alone
        else:
            self.pending.append(outcome)
            if not last and len(self.pending) < self.policy.evaluation_interval():
                return NOTHING_LEARNED
        return self._evaluate()

    def _evaluate(self) -> Learned:
        """Score the drafters on the queued rounds and learn from each, in order."""
        # Arms that cannot be the fastest are not scored (asleep for these rounds); the
        # chosen arms always are: their own rounds are what is measured.
        skip = [False] * len(self.policy.arms) if self.policy.scores_every_arm \
            else self.planner.evaluation_skips(self._costly())
        costly = self._costly()
        for round_ in self.pending:
            # (A costly arm's round planned at K = 0 measured nothing of it: its catch-up
            # forward is not forced for that.)
            arm = round_.feedback.arm
            if round_.feedback.drafted or not (costly and costly[arm]):
                skip[arm] = False
        start = self.clock()
        scored = self.evaluator(self.pending, skip)
        evaluate_s = self.clock() - start
        evaluated, values = [], []
        for round_, gammas in zip(self.pending, scored, strict=True):
            quiet = round_.feedback.silent  # known already when the round was chosen among awake arms
            if quiet is None:
                quiet = self.evaluator.silent(round_)
            # Not scored (skipped, or the evaluator lacked what it is scored from): asleep here.
            if any(g is None for g in gammas):
                quiet = [bool(q) or g is None for q, g in zip(quiet or [False] * len(gammas), gammas)]
            self.learn(replace(round_.feedback, gammas=gammas, silent=quiet))
            evaluated.append((round_.feedback.arm, gammas))
            values.append(round_values(self.planner, gammas))
        self.pending = []
        self._batch_skips = None
        self.policy.after_evaluation()
        return Learned(evaluated, evaluate_s, values)

    # --- the learned state, saved as one JSON object (`--policy-state`) ---------------------

    def state_dict(self) -> dict:
        """The policy's state_dict with the planner's learned fields ("costs", "acceptance")
        added to its "state" object."""
        saved = self.policy.state_dict()
        saved["state"].update(self.planner.state())
        return saved

    def load_state_dict(self, saved: dict) -> None:
        """Start every later prompt from `saved` (as written by state_dict). Garbage raises
        ValueError before the policy or the planner keeps anything."""
        state = self.policy.saved_state(saved)
        self.planner.check_state(state)
        self.policy.load_state_dict(saved)
        self.planner.load_state(state)
