"""One request's drafting inside a serving engine: its drafters' forks, its policy driver,
the drafts it offers each step (the policy's drafter first; under full information every
awake drafter's, for the batch plan to choose from) and the one it sent, all scored
against what the engine committed.

The engine verifies and commits; this side only sees the tokens each step committed. They
are the feedback: the sent draft's accepted prefix is its match with them (the engine may
have scheduled less of it), and under full information every drafter is scored at each
committed position by whether its fresh lookup there proposes the committed token: exactly
the target's argmax acceptance under greedy decoding, and under sampling an unbiased
estimate of p(proposal), since the committed token is drawn from p.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

from specdraft.drafters import Drafter
from specdraft.drafters.lookup_base import LookupDrafter
from specdraft.learning.batch_planner import ALONE, NO_DRAFT_YET, MatchCalibration, draft_outcome, support
from specdraft.learning.driver import PolicyDriver, RoundOutcome, ScoringFunction
from specdraft.learning.feedback import RoundFeedback


class Offer(NamedTuple):
    """One drafter's draft for the request's next step."""

    arm: int
    tokens: list[int]
    match_length: int  # the lookup's match behind it (the calibration's context, as is the next)
    supported: int  # whether other drafters' offers start alike (batch_planner.support)


class RequestDrafting:
    def __init__(self, drafters: list[Drafter], driver: PolicyDriver, calibration: MatchCalibration):
        self.drafters, self.driver, self.calibration = drafters, driver, calibration
        self.context: list[int] = []
        self.produced = 0
        self.offers: list[Offer] = []  # this step's drafts, the policy's first
        self.draft_seconds = 0.0  # host time the offers took
        self.sent: tuple[Offer, int] | None = None  # the offer sent and how many of its tokens
        self.outcome = NO_DRAFT_YET  # how the last draft sent fared (the calibration's context)
        driver.start_prompt(ScoringFunction(self._evaluate) if driver.full_information else None)

    # --- feedback from the step that just ran -------------------------------------------

    def committed(self, context: list[int], tokens: Sequence[int], step_seconds: float) -> tuple[int, int]:
        """The engine committed `tokens` (the last of `context`, now the request's whole text,
        a list this state keeps). Returns (drafted, accepted) of the draft this step verified."""
        start = len(context) - len(tokens)
        self.context = context
        self.produced += len(tokens)
        if self.sent is None:
            return 0, 0
        (arm, offered, _, _), count = self.sent
        self.sent = None
        draft = offered[:count]
        accepted = 0
        while accepted < min(len(draft), len(tokens) - 1) and draft[accepted] == tokens[accepted]:
            accepted += 1
        self._calibrate(tokens)
        if draft:
            self.outcome = draft_outcome(len(draft), accepted)
        alphas = [1.0] * accepted + ([0.0] if accepted < len(draft) else [])
        feedback = RoundFeedback(arm, len(draft), accepted, alphas, round_seconds=step_seconds + self.draft_seconds,
                                 draft_seconds=self.draft_seconds, verify_seconds=step_seconds,
                                 verify_width=len(draft) + 1)
        self.driver.finish_round(RoundOutcome(feedback, start, len(tokens)), last=False)
        return len(draft), accepted

    def _calibrate(self, tokens: Sequence[int]) -> None:
        """Every offered draft, sent or not, against the committed tokens: each matching
        token is one accepted, the first that differs one rejected, and positions past the
        committed tokens unobserved. Exact under greedy decoding (the committed tokens are
        the target's argmax chain whatever was sent) and unbiased under sampling (they
        follow the target's distribution); a request that sends nothing still teaches the
        chances that decide when it sends again."""
        for arm, offered, match_length, supported in self.offers:
            alignment = []
            for drafted, committed in zip(offered, tokens):
                alignment.append(1.0 if drafted == committed else 0.0)
                if drafted != committed:
                    break
            if alignment:
                self.calibration.observe(arm, match_length, self.outcome, supported, alignment)

    def _evaluate(self, rounds: Sequence[RoundOutcome], skip: Sequence[bool]) -> list[list[list[float] | None]]:
        """Every drafter's gamma at each committed position of the queued rounds (see above)."""
        return [[None if skip[i] else drafter.committed_scores(self.context, round_.start, round_.count)
                 for i, drafter in enumerate(self.drafters)] for round_ in rounds]

    # --- the next draft -----------------------------------------------------------------

    def propose(self) -> list[list[float]]:
        """This step's offers (up to the profile's draft_tokens each), the policy's drafter
        first, and per offer the chance that each of its tokens and every one before it are
        accepted. Under full information every drafter that proposes anything offers (the
        batch plan may send another drafter's draft when the calibration expects more of
        it: the policy still learns from every drafter's score); a bandit policy learns
        from the drafter it chose, so only that one offers."""
        began = time.perf_counter()
        k = self.driver.draft_tokens
        drafts: list[Offer | None] = [None] * len(self.drafters)
        awake = None
        if self.driver.wants_awake or self.driver.full_information:
            # One lookup per drafter: what it would draft says whether it is awake. A bandit
            # sends only its choice, so the others need only say that (one token).
            depth = k if self.driver.full_information else 1
            drafts = [self._draft(arm, depth) for arm in range(len(self.drafters))]
            awake = [not d.traits.may_sleep or bool(o and o.tokens) for d, o in zip(self.drafters, drafts)]
        chosen = self.driver.choose_drafter(awake if self.driver.wants_awake else None)
        drafted = drafts[chosen]
        first = drafted if drafted is not None and self.driver.full_information else self._draft(chosen, k)
        others = [o for o in drafts if o is not None and o.arm != chosen and o.tokens] \
            if self.driver.full_information else []
        offers = [first, *others]
        starts = [o.tokens[0] for o in offers if o.tokens]
        self.offers = [self._supported(o, starts) for o in offers]
        self.draft_seconds = time.perf_counter() - began
        return [self.calibration.chances(o.arm, o.match_length, self.outcome, o.supported, len(o.tokens))
                if o.tokens else [] for o in self.offers]

    @staticmethod
    def _supported(offer: Offer, starts: list[int]) -> Offer:
        if not offer.tokens:
            return offer
        others = list(starts)
        others.remove(offer.tokens[0])  # its own start
        return offer._replace(supported=support(offer.tokens[0], others))

    def _draft(self, arm: int, k: int) -> Offer:
        drafter = self.drafters[arm]
        if drafter.traits.drafts_nothing or k <= 0:
            return Offer(arm, [], 0, ALONE)
        if isinstance(drafter, LookupDrafter):  # the tokens as a list: no tensor to build and read back
            tokens = drafter.lookup(self.context, len(self.context), k)
            return Offer(arm, tokens, drafter.last_match if tokens else 0, ALONE)
        draft = drafter.propose(self.context, k)
        return Offer(arm, draft.tokens.tolist(), draft.match_length, ALONE)

    def send(self, choice: int, count: int) -> tuple[int, list[int]]:
        """What the batch plan sends: the first `count` tokens of offer `choice`, and its arm."""
        offer = self.offers[choice]
        self.sent = (offer, count)
        return offer.arm, offer.tokens[:count]

    def finish(self) -> None:
        """The request is done: drafters that learn from earlier text record it."""
        for drafter in self.drafters:
            drafter.end_prompt(self.context)
