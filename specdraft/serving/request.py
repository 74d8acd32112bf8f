"""One request's drafting inside a serving engine: its drafters' forks, its policy driver,
and the draft it sent last, scored against what the engine committed.

The engine verifies and commits; this side only sees the tokens each step committed. They
are the feedback: the sent draft's accepted prefix is its match with them (the engine may
have scheduled less of it), and under full information every drafter is scored at each
committed position by whether its fresh lookup there proposes the committed token: exactly
the target's argmax acceptance under greedy decoding, and under sampling an unbiased
estimate of p(proposal), since the committed token is drawn from p.
"""

from __future__ import annotations

import time
from typing import Sequence

from specdraft.drafters import Drafter
from specdraft.learning.batch_planner import NO_DRAFT_YET, MatchCalibration, draft_outcome
from specdraft.learning.driver import PolicyDriver, RoundOutcome
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.policies.base import PLAIN_ARM


class RequestDrafting:
    def __init__(self, drafters: list[Drafter], driver: PolicyDriver, calibration: MatchCalibration):
        self.drafters, self.driver, self.calibration = drafters, driver, calibration
        self.context: list[int] = []
        self.produced = 0
        self.sent: tuple[int, list[int], float, int] | None = None  # arm, tokens, host seconds, match length
        self.offer: tuple[int, list[int], float, int] = (0, [], 0.0, 0)
        self.outcome = NO_DRAFT_YET  # how the last draft sent fared (the calibration's context)
        driver.start_prompt(self._evaluate if driver.full_information else None)

    # --- feedback from the step that just ran -------------------------------------------

    def committed(self, context: list[int], tokens: Sequence[int], step_seconds: float) -> tuple[int, int]:
        """The engine committed `tokens` (the last of `context`, now the request's whole text,
        a list this state keeps). Returns (drafted, accepted) of the draft this step verified."""
        start = len(context) - len(tokens)
        self.context = context
        self.produced += len(tokens)
        if self.sent is None:
            return 0, 0
        arm, draft, draft_seconds, match_length = self.sent
        self.sent = None
        accepted = 0
        while accepted < min(len(draft), len(tokens) - 1) and draft[accepted] == tokens[accepted]:
            accepted += 1
        alphas = [1.0] * accepted + ([0.0] if accepted < len(draft) else [])
        if draft:
            self.calibration.observe(arm, match_length, self.outcome, alphas)
            self.outcome = draft_outcome(len(draft), accepted)
        feedback = RoundFeedback(arm, len(draft), accepted, alphas, round_seconds=step_seconds + draft_seconds,
                                 draft_seconds=draft_seconds, verify_seconds=step_seconds,
                                 verify_width=len(draft) + 1)
        self.driver.finish_round(RoundOutcome(feedback, start, len(tokens)), last=False)
        return len(draft), accepted

    def _evaluate(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool]) -> list[list[list[float] | None]]:
        """Every drafter's gamma at each committed position of the queued rounds (see above)."""
        return [[None if skip[i] else drafter.committed_scores(self.context, round_.start, round_.count)
                 for i, drafter in enumerate(self.drafters)] for round_ in rounds]

    # --- the next draft -----------------------------------------------------------------

    def propose(self) -> list[float]:
        """Draft with the chosen drafter (up to the profile's draft_tokens; kept as the offer
        `send` cuts) and return, per drafted token, the chance that it and every token
        before it are accepted."""
        began = time.perf_counter()
        awake = None
        if self.driver.wants_awake:
            awake = [not d.may_sleep or d.awake_at(self.context, len(self.context)) for d in self.drafters]
        arm = self.driver.choose_drafter(awake)  # the batch plan, not the round planner, sets its length
        drafter = self.drafters[arm]
        tokens: list[int] = []
        match_length = 0
        if drafter.name != PLAIN_ARM and self.driver.draft_tokens > 0:
            draft = drafter.propose(self.context, self.driver.draft_tokens)
            tokens, match_length = draft.tokens.tolist(), draft.match_length
        self.offer = (arm, tokens, time.perf_counter() - began, match_length)
        return self.calibration.chances(arm, match_length, self.outcome, len(tokens)) if tokens else []

    @property
    def offered_arm(self) -> int:
        return self.offer[0]

    def send(self, count: int) -> list[int]:
        """What the batch plan sends of the offered draft: its first `count` tokens."""
        arm, tokens, seconds, match_length = self.offer
        self.sent = (arm, tokens[:count], seconds, match_length)
        return tokens[:count]

    def finish(self) -> None:
        """The request is done: drafters that learn from earlier text record it."""
        for drafter in self.drafters:
            drafter.end_prompt(self.context)
