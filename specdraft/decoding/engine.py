"""The round loop (DESIGN.md section 1): select, draft, verify, accept, commit, feedback.

The engine knows nothing about text: it takes prompt token ids and yields one RoundRecord
per round with the tokens that round committed. It never branches on drafter kind or
policy. One host synchronisation per round: reading the packed verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specdraft.cached_lm import CachedLM
from specdraft.decoding.sampling import SamplingParams, plain_probs, sampling_probs
from specdraft.decoding.verify import verify_greedy, verify_sampling
from specdraft.drafters.base import Drafter
from specdraft.policies.base import Policy, RoundFeedback


@dataclass(frozen=True)
class EngineSettings:
    draft_tokens: int
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    reset_policy: bool = True  # forget what the policy learned before each prompt
    evaluate_all: bool = False  # full information: score every drafter on each verified chunk


@dataclass
class RoundRecord:
    arm: int
    drafter: str
    drafted: int
    accepted: int  # drafted tokens accepted; the round commits accepted + 1 before truncation
    tokens: list[int]  # committed this round (cut at EOS or at max_new_tokens)
    alphas: list[float]  # 1 - TV(p_j, q_j) per drafted position
    draft_s: float
    verify_s: float
    overhead_s: float
    finish: str | None = None  # "eos" or "length" on the last round
    evaluate_s: float = 0.0
    # Rounds whose evaluation finished in this round, as (chosen arm, gammas): this round
    # alone, or several when the policy batches evaluation every m rounds.
    evaluated: list[tuple[int, list[list[float]]]] | None = None

    @property
    def gammas(self) -> list[list[float]] | None:
        """This round's gammas per drafter and committed position, if evaluated now (it is
        always the last of the rounds evaluated together)."""
        return self.evaluated[-1][1] if self.evaluated else None

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s + self.overhead_s + self.evaluate_s


class SpeculativeEngine:
    def __init__(
        self,
        target: CachedLM,
        drafters: Sequence[Drafter],
        policy: Policy,
        settings: EngineSettings,
        generator: torch.Generator | None = None,
    ):
        self.target = target
        self.drafters = list(drafters)
        self.policy = policy
        self.settings = settings
        self.generator = generator

    def generate(self, prompt_ids: Sequence[int]) -> Iterator[RoundRecord]:
        if not prompt_ids:
            raise ValueError("the prompt is empty: nothing to condition on")
        s = self.settings
        device = self.target.device
        self.target.reset()
        for drafter in self.drafters:
            drafter.reset()
        if s.reset_policy:
            self.policy.reset()

        context = list(prompt_ids)
        if len(context) > 1:  # prefill all but the last token; the first verify feeds that one
            self.target.feed(torch.tensor(context[:-1], dtype=torch.long, device=device), keep=1)
        last = torch.tensor(context[-1:], dtype=torch.long, device=device)  # [1]
        produced = 0
        pending: list[_PendingRound] = []  # committed rounds awaiting full-information evaluation
        while produced < s.max_new_tokens:
            t0 = time.perf_counter()
            arm = self.policy.select()
            drafter = self.drafters[arm]
            # Never draft past the budget: the round commits at most k + 1 tokens.
            k = min(s.draft_tokens, s.max_new_tokens - produced - 1)
            t1 = time.perf_counter()
            draft = drafter.propose(context, k) if k > 0 else drafter.empty_draft()
            k = draft.tokens.shape[0]
            t2 = time.perf_counter()

            logits = self.target.feed(torch.cat([last, draft.tokens]), keep=0)  # [k + 1, V]
            if s.sampling.greedy:
                p = None
                verdict = verify_greedy(logits, draft.tokens, draft.probs)
            else:
                p = sampling_probs(logits, s.sampling)
                verdict = verify_sampling(p, draft.tokens, draft.probs, self.generator)
            # The round's single device-to-host sync: accepted count, tokens and alphas at once.
            # float64 holds every token id exactly.
            packed = torch.cat(
                [verdict.n_accepted.view(1).double(), verdict.tokens.double(), verdict.alphas.double()]
            ).tolist()
            n = int(packed[0])
            tokens = [int(t) for t in packed[1 : n + 2]]
            alphas = packed[k + 2 :]
            t3 = time.perf_counter()

            start = len(context)
            self.target.crop(start + n)  # keeps context[:-1] + last + n accepted drafts
            drafter.on_commit(n)
            last = verdict.tokens.index_select(0, verdict.n_accepted.view(1))
            finish = None
            for i, token in enumerate(tokens):
                if token in s.eos_ids:
                    tokens, finish = tokens[: i + 1], "eos"
                    break
            if produced + len(tokens) >= s.max_new_tokens:
                tokens = tokens[: s.max_new_tokens - produced]
                finish = finish or "length"
            context.extend(tokens)
            produced += len(tokens)
            t4 = time.perf_counter()
            feedback = RoundFeedback(arm, k, n, alphas, t3 - t0)
            evaluated = None
            if s.evaluate_all:
                target_probs = plain_probs(logits[: len(tokens)]) if p is None else p[: len(tokens)]
                pending.append(_PendingRound(start, len(tokens), arm, verdict.alphas, target_probs, feedback))
                if finish or len(pending) >= self.policy.evaluation_interval():
                    evaluated = self._evaluate(context, pending)
                    pending = []
            t5 = time.perf_counter()
            if not s.evaluate_all:
                self.policy.update(feedback)
            for done in evaluated or ():
                self.policy.update(done)
            t6 = time.perf_counter()
            yield RoundRecord(arm, drafter.name, k, n, tokens, alphas, t2 - t1, t3 - t2,
                              (t1 - t0) + (t4 - t3) + (t6 - t5), finish, t5 - t4,
                              [(fb.arm, fb.gammas) for fb in evaluated] if evaluated else None)
            if finish:
                return

    def _evaluate(self, context: list[int], pending: list["_PendingRound"]) -> list[RoundFeedback]:
        """HedgeSpec's evaluation phase over the pending rounds: gamma of every drafter at
        every committed position. Every drafter ends caught up, so switching later costs
        nothing. Positions a drafter did not draft are scored in one forward per contiguous
        span (batching m rounds into one forward is what makes `update_every` cheap); one
        host sync reads everything."""
        per_drafter = []
        for i, drafter in enumerate(self.drafters):
            parts, span = [], []  # span: consecutive pending rounds this drafter did not draft
            for round_ in pending:
                if round_.arm != i or not drafter.draft_alignment_is_score:
                    span.append(round_)
                    continue
                parts.extend(self._score_span(drafter, context, span))
                span = []
                known = min(round_.count, round_.alphas.shape[0])  # its draft scored these already
                parts.append(round_.alphas[:known].to(round_.target_probs.dtype))
                if round_.count > known:
                    parts.append(drafter.score(context, round_.start + known, round_.count - known,
                                               round_.target_probs[known:]))
            parts.extend(self._score_span(drafter, context, span))
            per_drafter.append(torch.cat(parts))
        flat = torch.cat(per_drafter).double().tolist()  # [n_drafters * positions]: one sync
        total = sum(r.count for r in pending)
        rows = [flat[i * total : (i + 1) * total] for i in range(len(self.drafters))]
        out, offset = [], 0
        for round_ in pending:
            gammas = [row[offset : offset + round_.count] for row in rows]
            offset += round_.count
            fb = round_.feedback
            out.append(RoundFeedback(fb.arm, fb.drafted, fb.accepted, fb.alphas, fb.round_seconds, gammas))
        return out

    @staticmethod
    def _score_span(drafter: Drafter, context: list[int], span: list["_PendingRound"]) -> list[torch.Tensor]:
        if not span:
            return []
        probs = torch.cat([r.target_probs for r in span]) if len(span) > 1 else span[0].target_probs
        return [drafter.score(context, span[0].start, sum(r.count for r in span), probs)]


@dataclass
class _PendingRound:
    start: int  # context length before the round committed
    count: int  # tokens it committed
    arm: int
    alphas: torch.Tensor  # [k] the chosen drafter's alignment at its drafted positions
    target_probs: torch.Tensor  # [count, V] the target's distributions at the committed positions
    feedback: RoundFeedback
