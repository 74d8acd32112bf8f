"""The bases of the drafters that draft with a network: `ModelBackedDrafter` (the kinds
`model`, `layers`, `steered` and `head`) and, under it, `CausalLMDrafter` (those that feed
token ids to a causal LM: `model`, `layers`, `steered`).

A draft is a template whose steps each kind runs over its own cache (`lm`): `_start_draft`
catches up on the committed tokens not yet seen and gives the last position's logits,
`_step` feeds a drafted token, `_end_draft` closes the draft, and after the verify `_keep`
rolls the cache back to what was accepted. Drafting k tokens costs one catch-up forward plus
k - 1 single-token forwards: the last drafted token is never fed, because nothing needs its
successor's distribution. Drafting stops early once the next token's chance of being
accepted (learned from the drafter's own confidence, `learning/confidence.py`) is not worth
its time, or below a profile's fixed `stop_below` confidence; the learned rule may also
carry a draft past the plan's k.

Under full information a `CausalLMDrafter` is scored on every committed position anyway:
that forward runs on through the last committed token and keeps its logits, so the next
draft starts without a forward of its own.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import torch

from specdraft.core.sampling import distributions, greedy_tokens, sample
from specdraft.core.verify import overlap
from specdraft.drafters.base import Draft, DraftContext, Drafter, Hidden, TrajectoryScores
from specdraft.learning.confidence import ConfidenceCalibration, StopRule


class DraftLM(Protocol):
    """What a model-backed drafter's `lm` offers: its network with the cache it drafts over
    (a `CachedLM`, the `layers` kind's `TargetPrefix`, the `head` kind's `HeadCache`)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def clock(self) -> Callable[[], float]:
        """A clock in seconds that waits for the device first (what it times is real work)."""

    @property
    def length(self) -> int:
        """How many tokens the cache has consumed."""

    def reset(self) -> None: ...

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens."""


class TokenLM(DraftLM, Protocol):
    """A `DraftLM` fed token ids: a `CachedLM`, or the target's first layers over its cache."""

    @property
    def model(self) -> torch.nn.Module: ...

    def feed(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Consume `tokens` [n]; the logits of the last `keep` positions [keep, V]."""

    def uncached_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] at every position of `tokens`, leaving the cache alone."""


class ModelBackedDrafter(Drafter):
    """Drafts token by token from a network's logits, stopping early by its confidence."""

    lm: DraftLM

    def __init__(self, name: str, ctx: DraftContext, lm: DraftLM, stop_below: float | None = None):
        super().__init__(name, ctx)
        self.lm = lm
        self.stop_below = stop_below
        self.calibration = ConfidenceCalibration()  # kept across prompts: it describes the pair
        self._confidences: list[float] = []  # of the last draft's tokens, when stopping was on
        self._drafted_from = 0  # context length when the last draft started
        self._fed_drafts = 0  # drafted tokens that went into the cache
        # The token an early stop withheld (greedy): (context position, token, confidence).
        # Once the round is verified the target's token there says whether it would have
        # been accepted, so the calibration learns about the confidences it stops at, not
        # only about those it drafts (otherwise a bin it stops at never learns it was wrong).
        self._withheld: tuple[int, int, float] | None = None
        self._step_seconds: float | None = None  # a one-token draft step, as last measured

    def reset(self) -> None:
        self.lm.reset()
        self._withheld = None

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        if k <= 0:
            return self.empty_draft()
        unseen = len(context) - min(self.lm.length, len(context) - 1)
        started = self.lm.clock()
        logits = self._start_draft(context)  # [1, V]
        first_forward = self.lm.clock() - started
        self._judge_withheld(context)
        stopping = self.stop_below is not None or stop is not None
        learned = stop is not None and self.stop_below is None  # the rule, not a fixed floor
        # The learned rule may carry a draft of sure tokens past the plan's k (its horizon).
        limit = max(k, stop.horizon) if learned else k
        tokens, probs, self._confidences = [], [], []
        ranking: list[torch.Tensor] = []  # each position's scores, when runner-ups are asked for
        params = self.ctx.params
        one_hot = params.one_hot  # q not built (`_pick`)
        survive, expected, fed = 1.0, 1.0, 0  # expected: committed tokens, bonus included
        for j in range(limit):
            token, q = self._pick(logits, one_hot)
            if stopping:
                confidence = self._confidence(logits, q)
                acceptance = self.calibration.acceptance(confidence)
                # The first token is the plan's (the policy's K already judged it worth
                # drafting); the confidence prunes the tail, so a stop never wastes the
                # forward it needed.
                if j > 0 and (confidence < self.stop_below if self.stop_below is not None
                              else not stop.worth(j, expected, survive * acceptance)):
                    if params.greedy:
                        self._withheld = (len(context) + j, int(token), confidence)
                    break
                survive *= acceptance
                expected += survive
                self._confidences.append(confidence)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if runner_up:  # greedy's q is one-hot: the logits rank the rest
                ranking.append(self._wide(logits) if params.greedy else q)
            if j < limit - 1:
                if learned and not stop.worth(j + 1, expected, survive):
                    break  # not even a sure next token would pay: skip the forward that would judge it
                logits = self._step(token)
                fed += 1
        self._end_draft(context, fed)
        if not tokens:
            return self.empty_draft()
        catch_up = self._catch_up(unseen, first_forward, self.lm.clock() - started - first_forward, fed)
        return Draft(torch.cat(tokens).to(self.ctx.device), None if one_hot else torch.cat(probs).to(self.ctx.device),
                     catch_up, ranking=tuple(ranking) if runner_up else None)

    def _pick(self, logits: torch.Tensor, one_hot: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted token [1] and q [1, V]; q None where it is the argmax's one-hot, which
        nothing reads under exact greedy feedback: the draft then says so with probs None,
        as a lookup's does, and no row of the vocabulary's width is built per token."""
        params = self.ctx.params
        if one_hot:
            return self._greedy(logits), None
        q = distributions(self._wide(logits), params)
        return (self._greedy(logits) if params.greedy else sample(q, self.ctx.generator)), q

    def _catch_up(self, unseen: int, first: float, rest: float, steps: int) -> float:
        """The seconds of a draft's first forward (over `unseen` committed tokens, then `steps`
        one-token steps taking `rest`) spent catching up: what it took beyond a one-token step.
        A prompt's first forward is a prefill far dearer than a step, and, charged per drafted
        token, would make the drafter look several times cheaper than its steps are. Without
        a step in this draft, the last one measured stands in (pro rata by width before any)."""
        if steps:
            self._step_seconds = rest / steps
        if unseen <= 1:
            return 0.0
        if self._step_seconds is None:
            return first * (unseen - 1) / unseen
        return max(0.0, first - self._step_seconds)

    def _confidence(self, logits: torch.Tensor, q: torch.Tensor | None) -> float:
        """The drafter's top probability for its next token (one host read per drafted token,
        paid only while early stopping is on): its temperature-1 softmax under greedy
        decoding, where q is one-hot (or not built). A drafter whose outputs are not finite
        (NaN weights) is sure of nothing: 0, so its calibration and stop rule stay numbers."""
        top = float(torch.softmax(logits.float(), dim=-1).max() if self.ctx.params.greedy else q.max())
        return top if math.isfinite(top) else 0.0

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafted token [1] under greedy decoding: the argmax of the step's logits."""
        return greedy_tokens(logits)

    def _wide(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits over the target's whole vocabulary [1, V] (what `_start_draft` and
        `_step` give, unless a kind drafts over a vocabulary of its own)."""
        return logits

    @abstractmethod
    def _start_draft(self, context: Sequence[int]) -> torch.Tensor:
        """Catch up on the committed tokens not yet seen; the last position's logits ([1, V],
        or the kind's own vocabulary that `_wide` widens and `_greedy` maps)."""

    @abstractmethod
    def _step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed a drafted token [1]; the logits after it, as `_start_draft` gives them."""

    def _end_draft(self, context: Sequence[int], fed: int) -> None:
        self._drafted_from, self._fed_drafts = len(context), fed

    @abstractmethod
    def _keep(self, n_accepted: int) -> None:
        """Roll the cache back to the committed context plus what the verify accepted."""

    def on_commit(self, n_accepted: int, judged: bool = True) -> None:
        if self._confidences and not judged:
            self._confidences, self._withheld = [], None
        if self._confidences:
            if n_accepted < len(self._confidences):
                self._withheld = None  # a rejection before it: the withheld token was never reached
            self.calibration.observe(self._confidences, n_accepted)
            self._confidences = []
        self._keep(n_accepted)

    def _judge_withheld(self, context: Sequence[int]) -> None:
        """The token the last early stop withheld, against what the target committed there."""
        if self._withheld is not None:
            position, token, confidence = self._withheld
            if position < len(context):
                self.calibration.observe_one(confidence, context[position] == token)
            self._withheld = None


class CausalLMDrafter(ModelBackedDrafter):
    """Drafts by feeding token ids to a causal LM over a KV cache (`TokenLM`)."""

    lm: TokenLM
    # q at a position depends only on the context before it; scoring is a forward of its own
    # model over the tokens it did not draft.
    traits = replace(ModelBackedDrafter.traits, draft_alignment_is_score=True, scored_by_own_forward=True)

    def __init__(self, name: str, ctx: DraftContext, lm: TokenLM, stop_below: float | None = None):
        super().__init__(name, ctx, lm, stop_below)
        # (position, logits [1, V]): the distribution at `position` from the last token the
        # cache holds, kept by `score` for the next forward that would recompute it.
        self._next: tuple[int, torch.Tensor] | None = None

    def reset(self) -> None:
        super().reset()
        self._next = None

    def prepare_scoring(self, context: Sequence[int]) -> None:
        if self.lm.length < len(context) - 1:  # the last prompt token goes in with the first round's
            self._feed_context(context, len(context) - 1)

    def _start_draft(self, context: Sequence[int]) -> torch.Tensor:
        kept = self._kept_at(len(context))
        if kept is not None:  # scoring fed the whole context already
            return kept
        if self.lm.length >= len(context):  # cannot happen in a round; recover rather than mis-draft
            self._crop(len(context) - 1)
        return self._feed_context(context, len(context))

    def _feed_context(self, context: Sequence[int], end: int, keep: int = 1) -> torch.Tensor:
        """Feed the committed tokens context[cache length : end]; the logits of the last
        `keep` of them [keep, V]. (The steered kind steers each from its own position.)"""
        unseen = torch.tensor(context[self.lm.length : end], dtype=torch.long, device=self.lm.device)
        return self.lm.feed(unseen, keep=keep)

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        return self.lm.feed(token, keep=1)

    def _keep(self, n_accepted: int) -> None:
        """Roll the cache back to the committed context plus the accepted drafts it consumed."""
        self._crop(self._drafted_from + min(n_accepted, self._fed_drafts))

    def _crop(self, length: int) -> None:
        self.lm.crop(length)
        if self._next is not None and length < self._next[0]:
            self._next = None  # the token it was computed from is gone

    def _kept_at(self, position: int) -> torch.Tensor | None:
        """The kept logits when they are the distribution at `position`, the cache's end."""
        if self._next is not None and self._next[0] == position == self.lm.length:
            return self._next[1]
        return None

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        end = start + count  # fed through the last scored token: its logits start the next draft
        kept = self._kept_at(start)
        known = [] if kept is None else [kept]
        if not known and self.lm.length > start - 1:  # those positions' logits are gone: recompute them
            self._crop(start - 1)
        logits = torch.cat([*known, self._feed_context(context, end, keep=count + 1 - len(known))])  # [count + 1, V]
        self._next = (end, logits[count:])
        return overlap(target_probs, distributions(logits[:count], self.ctx.params).to(target_probs.device))

    @property
    def causal_lm(self) -> torch.nn.Module:
        return self.lm.model

    @torch.inference_mode()
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        self.reset()
        n = len(context) - prompt_len
        logits = self.lm.uncached_logits(context)[prompt_len - 1 : prompt_len - 1 + n].to(target_probs.device)  # [n, V]
        alpha = overlap(target_probs, distributions(logits, self.ctx.params)).tolist()
        generated = torch.tensor(context[prompt_len:], device=target_probs.device)
        match = (greedy_tokens(logits) == generated).tolist()
        runs = []
        for t in range(n):
            r = 0
            while r < k and t + r < n and match[t + r]:
                r += 1
            runs.append(r)
        return TrajectoryScores(alpha, [k] * n, runs, [alpha[t : t + k] for t in range(n)])
