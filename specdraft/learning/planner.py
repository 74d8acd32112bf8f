"""Planning a round (ARCHITECTURE.md, "Goodput"): the round cost model, each arm's
acceptance by draft position, and from them the draft length K, the early-stop rule and what
a round or an arm is expected to give (speedup, ceiling, ideal speedup, which arms are not
worth scoring, which arm has never drafted).

`RoundPlanner` is owned by the `PolicyDriver`: the driver asks the policy for an arm and the
planner for the rest of the round's plan, and teaches the planner every round it sees. A
policy reads the planner's estimates (to value rounds in its objective, break ties, probe
an untried arm) but never changes them. Plain Python: no torch.
"""

from __future__ import annotations

import random
from typing import Sequence

from specdraft.learning.confidence import StopRule
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.goodput import AcceptanceByPosition, RoundCostModel, best_draft_length, committed_by_length
from specdraft.learning.match_length import MatchAcceptance
from specdraft.learning.planner_state import apply_state, checked_state, learned_state
from specdraft.learning.round_plan import RoundPlan
from specdraft.learning.tree_planner import TreePlanner

PLAIN_ARM = "none"  # the arm that drafts nothing: a plain decoding round's name


def pool_arms(drafter_names: Sequence[str], allow_none: bool) -> list[str]:
    """The arms a policy chooses among, in the one order every part of a run uses: the
    pool's drafters, then the plain arm when the policy may choose a plain round."""
    return [name for name in drafter_names if name != PLAIN_ARM] + ([PLAIN_ARM] if allow_none else [])


def plain_arm_of(arms: Sequence[str]) -> int | None:
    """The index of the plain arm among `arms` (built by `pool_arms`), None without one."""
    return arms.index(PLAIN_ARM) if PLAIN_ARM in arms else None


def awake_arms(count: int, awake: Sequence[bool] | None) -> list[int]:
    """Indices of the awake arms among `count` (all of them when `awake` is None or none is awake)."""
    arms = [i for i in range(count) if awake is None or awake[i]]
    return arms or list(range(count))


class RoundPlanner:
    """Plans each round of a pool of `arms` drafting at most `draft_tokens` tokens.

    `objective` ("goodput" or "acceptance") is what the policy optimises, `draft_length`
    ("goodput": the best K by the estimates; "fixed": always the cap), `full_information`
    whether every drafter is scored each round. The cost model describes the machine and is
    never reset; acceptance by position carries over to the next prompt worth `carried_rounds`."""

    REPROBE = 8  # rounds at K = 0 before a drafter (bandit feedback) drafts one token again
    MAX_PROBE_GAP = 256
    # A drafter scored by a forward of its own (a model's catch-up over every token it did not
    # draft, its prompt's prefill first) is scored only while its estimated speedup is within
    # this share of the leader's, and every REVISIT_PROMPTS-th prompt it sat out (it may be stale).
    COSTLY_MARGIN = 0.9
    REVISIT_PROMPTS = 4

    def __init__(self, arms: Sequence[str], draft_tokens: int, *, plain_arm: int | None = None,
                 objective: str = "goodput", draft_length: str = "goodput", full_information: bool = False,
                 seed: int | None = None, carried_rounds: float = 4.0, tree: bool = False, runner_ups: bool = True):
        self.arms = list(arms)  # names: for saved states and messages
        self.plain_arm = plain_arm  # the arm that drafts nothing (a plain round), if the pool has one
        self.draft_tokens = draft_tokens
        self.goodput = objective == "goodput"
        self.dynamic_length = draft_length == "goodput"
        self.full_information = full_information
        self.carried_rounds = carried_rounds
        # Its own random stream: K's exploration never changes which arms a seeded policy picks.
        self.rng = random.Random(None if seed is None else seed + 1)
        self.costs = RoundCostModel(len(self.arms))
        self.acceptance = AcceptanceByPosition(len(self.arms), draft_tokens)
        self.by_match = MatchAcceptance(len(self.arms), draft_tokens)
        # Trees need every drafter scored every round and a speed to plan for.
        self.tree = (TreePlanner(self.arms, [arm == plain_arm for arm in range(len(self.arms))], self.costs, runner_ups)
                     if tree and full_information and self.goodput and self.dynamic_length else None)
        self.initial_state: dict | None = None  # loaded: where every reset starts
        self._idle = [0] * len(self.arms)  # rounds each arm was planned at K = 0 since its last draft
        self._probe_gap = [self.REPROBE] * len(self.arms)
        self._sat_out = [0] * len(self.arms)  # whole prompts a costly arm was not scored in, in a row
        self._scored = [False] * len(self.arms)  # scored in this prompt
        self.later_from_drafts = [False] * len(self.arms)  # see observe

    def reset(self) -> None:
        """Before a prompt that the policy resets at: acceptance by position starts from the
        earlier prompts' rates worth a few rounds (a pair's acceptance changes from prompt
        to prompt, far less than a flat prior says), the reprobe schedule starts over, and
        a loaded state is where it all starts. The cost model is kept: it describes this
        machine and these models, not the prompt."""
        self.acceptance = self.acceptance.carried_over(self.carried_rounds)
        self.by_match = self.by_match.carried_over(self.carried_rounds)
        self._idle = [0] * len(self.arms)
        self._probe_gap = [self.REPROBE] * len(self.arms)
        if self.tree is not None:
            self.tree.reset()
        if self.initial_state is not None:
            apply_state(self.initial_state, self.costs, self.acceptance, self.by_match)

    def start_prompt(self) -> None:
        """Before every prompt (whether the policy resets or not): counts the prompts each
        arm sat out of evaluation."""
        self._sat_out = [0 if scored else out + 1 for scored, out in zip(self._scored, self._sat_out)]
        self._scored = [False] * len(self.arms)

    def observe(self, feedback: RoundFeedback) -> None:
        """A round's timings and acceptance: what every round teaches, also one that
        full-information evaluation skipped. An arm in `later_from_drafts` (a drafter whose
        scores say how its first draft token would do, not its later ones: a head drafts on
        from its own predicted features) learns past position 1 from its own drafts only."""
        self.costs.observe(feedback.arm, feedback.drafted, feedback.draft_seconds, feedback.verify_seconds,
                           feedback.verify_width, feedback.branch_drafts)
        self._scored[feedback.arm] = True
        if self.tree is not None:
            self.tree.observe_runner_ups(feedback.runner_ups)
            if feedback.gammas is not None:
                self.tree.observe(feedback.gammas, feedback.silent)
        for arm, gammas in enumerate(feedback.gammas or ()):
            self._scored[arm] = self._scored[arm] or gammas is not None
        if feedback.match_length > 0 and feedback.drafted:
            self.by_match.observe(feedback.arm, feedback.match_length, feedback.alphas)
        if feedback.gammas is None:
            self.acceptance.observe(feedback.arm, feedback.alphas)
            return
        for arm, gammas in enumerate(feedback.gammas):  # every arm's acceptance along the committed chunk
            # A drafter silent here would not have drafted: its acceptance *when it
            # drafts*, which plans K, learns nothing from this chunk.
            if arm != self.plain_arm and not (feedback.silent and feedback.silent[arm]):
                self.acceptance.observe(arm, gammas[:1] if self.later_from_drafts[arm] else gammas)
        if self.later_from_drafts[feedback.arm] and feedback.accepted >= 1:  # its position 2 was reached
            self.acceptance.observe(feedback.arm, feedback.alphas[1:], first=2)

    def verify_width(self, tokens: int) -> int:
        """How many tokens to run a verify of `tokens` over: wider when that is cheaper."""
        return self.costs.verify.padded_width(tokens)

    # --- one round's plan ----------------------------------------------------------------

    def plan(self, arm: int, cap: int, awake: Sequence[bool] | None = None) -> RoundPlan:
        """The plan for a round of `arm`: its draft length (at most `cap`), early stop and
        expectations, and with trees on the `awake` drafters' branches that pay. One
        posterior draw of the arm's acceptance by position plans both K and how far the
        early stop looks ahead (Thompson sampling: see AcceptanceByPosition.rates), so a
        plan that explores deeper is not cut back by the means it set out to test."""
        rates = self._drawn_rates(arm, cap)
        k = self.draft_length(arm, cap, rates)
        expected, seconds = self.estimate(arm, k)
        stop = self.stop_rule(arm, k, expected, seconds, rates, horizon=cap)
        tree = self.tree.branches(arm, k, cap, awake) if self.tree is not None else None
        if tree is None:
            return RoundPlan(arm, k, stop, expected, seconds)
        branches, leaves, expected, seconds = tree
        return RoundPlan(arm, k, stop, expected, seconds, branches, leaves)

    def draft_length(self, arm: int, cap: int, rates: Sequence[float] | None = None) -> int:
        """How many tokens `arm` drafts this round, at most `cap`: always `cap` with
        draft_length = "fixed"; with "goodput", the K in 0..cap with the best estimated
        tokens per second (one token until the arm's draft cost is known: one token
        measures it, and a slow drafter's probe must not cost K of its forwards)."""
        best = self.best_length(arm, cap, rates if rates is not None else self._drawn_rates(arm, cap))
        if not self.dynamic_length or arm == self.plain_arm or cap == 0 or self.full_information:
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

    def trimmed_length(self, arm: int, match_length: int, drafted: int) -> int:
        """How many of a lookup draft's `drafted` tokens to verify, given its match length
        (`MatchAcceptance.trimmed_length`); all of them with fixed draft lengths or under
        the acceptance objective."""
        if not (self.goodput and self.dynamic_length):
            return drafted
        seconds = self.costs.seconds_by_length(arm, drafted)
        return self.by_match.trimmed_length(arm, match_length, seconds, self.rng)

    def best_length(self, arm: int, cap: int, rates: Sequence[float] | None = None,
                    seconds: Sequence[float | None] | None = None) -> int:
        """The draft length the estimates favour for `arm`: under `rates` (a posterior draw
        of its acceptance by position, so that deep positions unlucky once are tried
        again), else under the means (no side effects). `seconds`: the arm's
        `seconds_by_length` row up to at least `cap`, when the caller has it."""
        if arm == self.plain_arm:
            return 0
        if not self.dynamic_length or cap == 0:
            return cap
        seconds = self.costs.seconds_by_length(arm, cap) if seconds is None else seconds[: cap + 1]
        if any(s is None for s in seconds):
            return 1
        committed = (self.acceptance.committed_by_length(arm, cap) if rates is None
                     else committed_by_length(rates[:cap]))
        return best_draft_length(committed, seconds)

    def stop_rule(self, arm: int, k: int, expected: float, seconds: float | None,
                  rates: Sequence[float] | None = None, horizon: int | None = None) -> StopRule | None:
        """When a draft planned at `k` tokens from `arm` stops (None with draft_length =
        "fixed", where every round drafts K tokens, or while costs are unknown). It looks
        ahead with `rates` (the plan's draw), else the arm's mean acceptance by position,
        up to `horizon` >= k tokens: a drafter whose tokens are surer than the plan
        expected may draft past k while the longer round is expected to pay off (the plan
        judged K on average acceptance; the drafter sees each token's own confidence)."""
        if not self.dynamic_length or not seconds or k == 0:
            return None
        horizon = max(k, horizon or k)
        by_length = self.costs.seconds_by_length(arm, horizon)
        per_token = self.costs.token_seconds(arm, k)
        if per_token is None or any(t is None or t <= 0 for t in by_length):
            return None
        ahead = list(rates[:horizon]) if rates is not None else self.acceptance.rates(arm, horizon)
        return StopRule(by_length, ahead, expected / seconds * per_token)

    def _drawn_rates(self, arm: int, cap: int) -> list[float] | None:
        """One posterior draw of `arm`'s acceptance at positions 1 .. cap, where the draft
        length is planned from acceptance (None for the plain arm and fixed lengths)."""
        if not self.dynamic_length or arm == self.plain_arm:
            return None
        return self.acceptance.rates(arm, cap, self.rng)

    # --- what an arm is expected to give ---------------------------------------------------

    def estimate(self, arm: int, k: int) -> tuple[float, float | None]:
        """(E[committed | arm, k], T(arm, k) or None while unknown)."""
        return self.acceptance.expected_committed(arm, k), self.costs.round_seconds(arm, k)

    def speedup(self, arm: int, expected_tokens: float, k: int) -> float | None:
        """Estimated speedup over plain decoding of a round of `arm` drafting `k` tokens that
        commits `expected_tokens`: (tokens / T(arm, k)) / (1 / T(plain)); None while unknown."""
        return _speedup(expected_tokens, self.costs.round_seconds(arm, k), self.costs.round_seconds(arm, 0))

    def estimated_value(self, arm: int, seconds: Sequence[float | None] | None = None) -> float:
        """What `arm` is expected to give in the objective's units, at its best draft length:
        with the goodput objective its estimated speedup over plain decoding (0 while
        unknown), else its expected committed tokens. Learners break ties with it.
        (`seconds`: the arm's `seconds_by_length` row to K_max, when the caller has it.)"""
        seconds = self.costs.seconds_by_length(arm, self.draft_tokens) if seconds is None else seconds
        k = self.best_length(arm, self.draft_tokens, seconds=seconds)
        expected = self.acceptance.expected_committed(arm, k)
        return (_speedup(expected, seconds[k], seconds[0]) or 0.0) if self.goodput else expected

    def ceiling(self, arm: int, seconds: Sequence[float | None] | None = None) -> float | None:
        """`arm`'s estimated speedup if every token it drafted were accepted, at the best
        draft length for that (None while its costs are unknown): no acceptance could take
        it past this, so its draft cost alone decides it."""
        seconds = self.costs.seconds_by_length(arm, self.draft_tokens) if seconds is None else seconds
        values = [_speedup(k + 1.0, seconds[k], seconds[0]) for k in range(1, self.draft_tokens + 1)]
        return None if not values or any(v is None for v in values) else max(values)

    def evaluation_skips(self, costly: Sequence[bool] | None = None) -> list[bool]:
        """Per arm: not worth scoring now (full-information evaluation leaves it asleep for
        the round: its regret does not move). With the goodput objective, a drafter whose
        ceiling is below the leading arm's estimated speedup cannot be the fastest choice
        whatever its acceptance, until the leader's estimate falls to its ceiling (this
        spares drafters whose every token costs about a target forward); and a `costly` one
        sits out as `_costly_skips` says. Whatever it says, an arm a round drafted with is
        scored on that round (the driver)."""
        if not self.goodput or not self.dynamic_length:
            return [False] * len(self.arms)
        rows = self._seconds_rows()
        values, leader = self._values(rows)
        out = []
        for arm, sits_out in enumerate(self._costly_skips(costly, values, leader, rows)):
            ceiling = None if arm == self.plain_arm else self.ceiling(arm, rows[arm])
            out.append(sits_out or (ceiling is not None and ceiling < leader))
        return out

    def _costly_skips(self, costly: Sequence[bool] | None, values: list[float | None], leader: float,
                      rows: list[list[float | None]]) -> list[bool]:
        """Per arm: a `costly` drafter (scored by a forward of its own over every token it
        did not draft, its prompt's prefill first) the planner would not play now: measured,
        not being revisited (every REVISIT_PROMPTS-th prompt it sat out whole: acceptance
        changes with the task), and either not worth drafting at all (its best K is 0: it
        adds nothing to the plain arm) or estimated below COSTLY_MARGIN of the leader's
        speedup (`values`, `leader`: `_values`). Scoring it would cost its forwards every
        round for evidence that changes no choice; the driver also leaves it out of the
        policy's choice (asleep), since a learner that keeps a sleeping arm's old regret may
        still favour it."""
        if not any(costly or ()):
            return [False] * len(self.arms)
        out = []
        for arm in range(len(self.arms)):
            value = values[arm]
            if not costly[arm] or arm == self.plain_arm or value is None or self._sat_out[arm] >= self.REVISIT_PROMPTS:
                out.append(False)
                continue
            idle = self.best_length(arm, self.draft_tokens, seconds=rows[arm]) == 0
            out.append(idle or value < self.COSTLY_MARGIN * leader)
        return out

    def _seconds_rows(self) -> list[list[float | None]]:
        """Every arm's `seconds_by_length` row to K_max: what its estimates are priced with."""
        return [self.costs.seconds_by_length(arm, self.draft_tokens) for arm in range(len(self.arms))]

    def _values(self, rows: list[list[float | None]]) -> tuple[list[float | None], float]:
        """Each arm's `estimated_value` (None while its costs are unknown) and the largest known."""
        values = [None if arm != self.plain_arm and self.costs.draft[arm] is None
                  else self.estimated_value(arm, rows[arm]) for arm in range(len(self.arms))]
        return values, max((v for v in values if v is not None), default=0.0)

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

    def cost_probe(self, awake: Sequence[bool] | None = None) -> int | None:
        """With the goodput objective, an awake arm that never drafted yet (try it once: its
        draft cost is unknown until then)."""
        if not self.goodput:
            return None
        return next((i for i in awake_arms(len(self.arms), awake)
                     if self.costs.draft[i] is None and i != self.plain_arm), None)

    # --- persistence: saved beside the policy's own state --------------------------------

    def state(self) -> dict:
        """What the planner learned, as JSON fields of a saved policy state."""
        return learned_state(self.costs, self.acceptance, self.by_match)

    def check_state(self, state: dict) -> dict:
        """The planner's fields of a saved `state`, a private copy; ValueError on garbage."""
        return checked_state(state, len(self.arms), self.draft_tokens)

    def load_state(self, state: dict) -> None:
        """Start every later reset from the planner's fields of a saved `state` (checked
        first: garbage raises ValueError and nothing is kept)."""
        self.initial_state = self.check_state(state)
        self.reset()


def _speedup(expected_tokens: float, seconds: float | None, plain: float | None) -> float | None:
    """(tokens / seconds) / (1 / plain): a round's estimated speedup over plain decoding."""
    if seconds is None or plain is None or seconds <= 0:
        return None
    return expected_tokens / seconds * plain
