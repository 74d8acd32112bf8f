"""The round (ARCHITECTURE.md, "The round"): choose, draft, verify, commit, learn.

The engine knows nothing about text: it takes prompt token ids and yields one RoundRecord
per round with the tokens that round committed. A plan with branches (full-information
policies, `learning/tree_planner.py`) has further drafters propose too: their chains merge
into one token tree (`core/tree.py`) verified in one forward, and the accepted path is
committed; a plan without branches is the one-chain round. It never branches on drafter kind or
policy: the PolicyDriver plans the round (arm, draft length, early-stop price) and decides
what the policy learns and when, the PoolEvaluator scores drafters when the policy asks
for full information, from the target's hidden states for the layers the pool's drafters
name; drafters that draft from the target's features get them after every verify.

Host and device meet at two kinds of points. Data comes back once per round, in one read
of the packed verdict (plus one per draft token while a model drafter's early stop reads
its confidence); a tree round reads the drafts, the argmax and the alignments, and under
sampling once per draft its walk tries; a drafter that ranks tokens (while the planner may
plan runner-up leaves) and was wrong adds the read of where the target's token comes in
its order there. Time is read at every stopwatch lap (the round's start, the end of each
phase) and around an evaluation, and on CUDA or MPS each of those clock reads waits for
the device first (`stopwatch.device_clock`), so that the phase timings the cost model
learns from are the work's, not the kernel launches'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from specdraft.decoding.evaluation import PoolEvaluator, RoundEvidence
from specdraft.decoding.prefix_cache import PrefixCache
from specdraft.decoding.records import RoundLearning, RoundRecord, RoundTimes, RoundTree
from specdraft.decoding.tree_verify import Proposal, Verified, verify_tree
from specdraft.core.penalty import RepeatPenalty
from specdraft.core.sampling import SamplingParams, sampling_probs
from specdraft.core.stopwatch import Stopwatch
from specdraft.core.verify import read_if_finite, verify_greedy, verify_sampling
from specdraft.drafters.base import Draft, Drafter
from specdraft.learning.driver import PolicyDriver, RoundOutcome
from specdraft.learning.feedback import RoundFeedback
from specdraft.learning.round_plan import RoundPlan
from specdraft.learning.policies.base import Policy
from specdraft.learning.policies.objective import value_unit
from specdraft.models.cached_lm import CachedLM


@dataclass(frozen=True)
class EngineSettings:
    draft_tokens: int
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    penalty: RepeatPenalty = RepeatPenalty()  # applied to the target's rows inside the verify


@dataclass
class _Prompt:
    context: list[int]  # committed tokens, prompt included
    next_input: torch.Tensor  # [1]
    prefill_s: float  # the prefill's seconds, reported with the first round
    budget: int  # tokens this prompt may generate
    prefill_tokens: int = 0  # prompt tokens the target fed (the rest were in its cache)
    produced: int = 0


class SpeculativeEngine:
    def __init__(self, target: CachedLM, drafters: Sequence[Drafter], policy: Policy, settings: EngineSettings,
                 generator: torch.Generator | None = None):
        self.target = target
        self.drafters = list(drafters)
        self.settings = settings
        self.generator = generator
        self.driver = PolicyDriver(policy, settings.draft_tokens, settings.max_new_tokens, target.clock)
        self.driver.planner.later_from_drafts = [not d.traits.later_positions_scored for d in self.drafters]
        # Target layers whose hidden states some drafter is scored from: handed over by the
        # verify forward when the policy evaluates every drafter.
        self.hidden_layers = tuple(sorted({layer for d in self.drafters for layer in d.hidden_layers}))
        # Drafters that draft from the target's features get them at every committed
        # position, whichever arm drafted, so switching to them costs no catch-up forward.
        self.feature_drafters = [d for d in self.drafters if d.feature_layers]
        self.feature_layers = tuple(sorted({layer for d in self.feature_drafters for layer in d.feature_layers}))
        self.may_sleep = len(self.drafters) > 1 and any(d.traits.may_sleep for d in self.drafters)
        # A prompt that starts with what the cache holds prefills only the rest. Drafters that
        # read the target's features need them at every position: with one, nothing is kept.
        self.prefix = PrefixCache(target, enabled=not self.feature_layers)

    @property
    def policy(self) -> Policy:
        return self.driver.policy

    def generate(self, prompt_ids: Sequence[int], budget: int | None = None) -> Iterator[RoundRecord]:
        """The rounds of one prompt; `budget`: at most this many tokens (the settings' cap at most)."""
        state = self._start(prompt_ids, min(budget or self.settings.max_new_tokens, self.settings.max_new_tokens))
        try:
            while state.produced < state.budget:
                watch = Stopwatch(self.target.clock)
                awake = self._awake(state.context)
                plan = self.driver.choose(state.produced, awake)
                watch.lap("overhead")
                plan, proposals = self._propose(state.context, plan, watch)
                arm, k, draft = plan.arm, plan.draft_tokens, proposals[0].draft
                drafter = self.drafters[arm]
                verified = self._verify_tree(state.context, proposals) \
                    if len(proposals) > 1 or any(p.runner_ups and p.draft.ranking for p in proposals) \
                    else self._verify(state.context, state.next_input, draft, arm)
                watch.lap("verify")
                start = len(state.context)
                tokens, finish = self._commit(state, verified)
                feedback = RoundFeedback(arm, len(verified.alphas), verified.kept[0][1], verified.alphas,
                                         watch.elapsed, draft_seconds=proposals[0].seconds,
                                         verify_seconds=watch["verify"], verify_width=verified.width,
                                         silent=None if awake is None else [not a for a in awake],
                                         branch_drafts=tuple((p.arm, p.drafted, p.seconds) for p in proposals[1:]),
                                         match_length=draft.match_length, runner_ups=tuple(verified.runner_up_ranks))
                evidence = self._evidence(verified, len(tokens)) if self.driver.full_information else None
                learned = self.driver.finish_round(RoundOutcome(feedback, start, len(tokens), evidence),
                                                   last=finish is not None)
                watch.lap("overhead")
                watch.move(learned.evaluate_s, "overhead", "evaluate")
                prefill_s, prefill_tokens = state.prefill_s, state.prefill_tokens  # reported once: first round
                state.prefill_s, state.prefill_tokens = 0.0, 0
                yield RoundRecord(arm=arm, drafter=drafter.name, drafted=feedback.drafted, accepted=verified.accepted,
                                  tokens=tokens, alphas=verified.alphas, finish=finish, verify_width=verified.width,
                                  times=RoundTimes(watch["draft"], watch["verify"], watch["overhead"], watch["evaluate"],
                                                   prefill_s, prefill_tokens),
                                  learning=RoundLearning(k, plan.expected_tokens, plan.expected_seconds,
                                                         learned.evaluated or None, learned.values or None,
                                                         value_unit(self.driver.planner)),
                                  tree=self._tree_report(verified, proposals))
                if finish:
                    return
        finally:  # also when the caller stops early: what was generated is still text
            for drafter in self.drafters:
                drafter.end_prompt(state.context)
            self.prefix.remember(state.context)

    def _propose(self, context: list[int], plan: RoundPlan, watch: Stopwatch) -> tuple[RoundPlan, list[Proposal]]:
        """The round's proposals: the chosen drafter's draft (in a chain round a lookup's is
        cut to what its match length makes worth verifying, `_trim`), then the plan's
        branches, each with the runner-up leaves the plan gives it; and the plan as trimmed."""
        arm, k = plan.arm, plan.draft_tokens
        drafter = self.drafters[arm]
        ranks = self.driver.wants_runner_ups or bool(plan.runner_ups)  # drafters give runner-ups
        draft = drafter.propose(context, k, plan.stop, runner_up=ranks) if k > 0 else drafter.empty_draft()
        if draft.match_length and not (plan.branches or plan.runner_ups):
            draft, plan = self._trim(arm, draft, plan)
        watch.lap("draft")
        leaves = {a: (n, width) for a, n, width in plan.runner_ups}
        proposals = [Proposal(arm, draft, max(0.0, watch["draft"] - draft.catch_up_seconds), *leaves.get(arm, (0, 1))),
                     *self._branches(context, plan.branches, leaves, ranks)]
        watch.lap("draft")
        return plan, proposals

    def _trim(self, arm: int, draft: Draft, plan: RoundPlan) -> tuple[Draft, RoundPlan]:
        """A lookup draft cut to the length its match length makes worth verifying
        (`RoundPlanner.trimmed_length`; a chain round's, a tree's chains were planned
        together), with the plan's expectations for what is left."""
        drafted = draft.tokens.shape[0]
        keep = self.driver.planner.trimmed_length(arm, draft.match_length, drafted)
        if keep >= drafted:
            return draft, plan
        expected, seconds = self.driver.planner.estimate(arm, keep)
        return (replace(draft, tokens=draft.tokens[:keep], probs=None if draft.probs is None else draft.probs[:keep]),
                replace(plan, draft_tokens=keep, expected_tokens=expected, expected_seconds=seconds))

    def _awake(self, context: list[int]) -> list[bool] | None:
        """Which drafters would propose anything after `context` (the rest are asleep this
        round), when the policy chooses among awake arms and some drafter may sleep."""
        if not (self.may_sleep and self.driver.wants_awake):
            return None
        return [drafter.awake_at(context, len(context)) for drafter in self.drafters]

    def _start(self, prompt_ids: Sequence[int], budget: int) -> _Prompt:
        """Reset the caches (the target's to its prefix of the prompt) and the policy; prefill the target and the drafters scored now."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: nothing to condition on")
        started = self.target.clock()
        context = list(prompt_ids)
        kept = self.prefix.take(context)
        if kept:
            self.target.crop(kept)
        else:
            self.target.reset()
        for drafter in self.drafters:
            drafter.reset()
        self.driver.start_prompt(PoolEvaluator(self.drafters, context, self.settings.sampling) if self.driver.full_information else None)
        device = self.target.device
        if len(context) - 1 > kept:  # prefill all but the last token; the first verify feeds that one
            _, hidden = self.target.feed_with_hidden(
                torch.tensor(context[kept:-1], dtype=torch.long, device=device), 1, self.feature_layers)
            self._hand_over(kept, hidden, len(context) - 1 - kept)
        if self.driver.full_information:  # (a drafter the planner would not score catches up if it drafts)
            for drafter, scored in zip(self.drafters, self.driver.scored_now(), strict=True):
                if scored:
                    drafter.prepare_scoring(context)
        return _Prompt(context, torch.tensor(context[-1:], dtype=torch.long, device=device),
                       self.target.clock() - started, budget, len(context) - 1 - kept)

    def _branches(self, context: list[int], branches: Sequence[tuple[int, int]], leaves: dict[int, tuple[int, int]],
                  ranks: bool) -> list[Proposal]:
        """The plan's further chains: each branch drafter proposes its depth (no early stop:
        the planner chose the depth for the tree as a whole), with the runner-up leaves
        `leaves` plans for it."""
        out = []
        for arm, depth in branches:
            started = self.target.clock()
            draft = self.drafters[arm].propose(context, depth, runner_up=ranks)
            out.append(Proposal(arm, draft, max(0.0, self.target.clock() - started - draft.catch_up_seconds),
                                *leaves.get(arm, (0, 1))))
        return out

    def _tree_report(self, verified: Verified, proposals: list[Proposal]) -> RoundTree:
        """How the round's chains fared, by drafter name."""
        name = lambda arm: self.drafters[arm].name  # noqa: E731
        return RoundTree(branches=[(name(a), p.drafted, n) for (a, n), p in zip(verified.kept, proposals)],
                         tree_size=verified.tree_size, winner=self._winner(verified),
                         runner_ups=[(name(a), n) for a, n in verified.runner_up_leaves],
                         runner_up_won=None if verified.runner_up_won is None else name(verified.runner_up_won))

    def _winner(self, verified: Verified) -> str | None:
        """The drafter whose chain (or runner-up leaf) the committed tokens followed
        furthest (the chosen one on a tie), None when no drafted token was accepted."""
        if verified.runner_up_won is not None:
            return self.drafters[verified.runner_up_won].name
        arm, kept = max(verified.kept, key=lambda item: item[1])  # (max keeps the first of equals)
        return self.drafters[arm].name if kept else None

    def _verify(self, context: list[int], next_input: torch.Tensor, draft: Draft, arm: int) -> Verified:
        """One target forward over [last committed token, draft] and lossless acceptance.

        When the cost curve says a wider forward is cheaper (a BLAS kernel switch), the
        input is padded with copies of its last token: causal attention keeps them out of
        every real position, their logits are dropped, and the commit crops them from the
        cache with the rejected drafts."""
        k = draft.tokens.shape[0]
        layers = self._verify_layers()
        tokens = torch.cat([next_input, draft.tokens])
        width = self.driver.verify_width(k + 1)
        if width > k + 1:
            tokens = torch.cat([tokens, tokens[-1:].expand(width - k - 1)])
        logits, hidden = self.target.feed_with_hidden(tokens, 0, layers)
        if width > k + 1:
            logits, hidden = logits[: k + 1], {layer: h[: k + 1] for layer, h in hidden.items()}  # [k + 1, V]
        if self.settings.penalty.active:
            logits = self.settings.penalty.chain(logits, context, draft.tokens)
        probs = None
        if self.settings.sampling.greedy:
            verdict = verify_greedy(logits, draft.tokens, draft.probs, self.settings.sampling)
        else:
            probs = sampling_probs(logits, self.settings.sampling)
            verdict = verify_sampling(probs, draft.tokens, draft.probs, self.generator)
        # The round's one device-to-host read: accepted count, tokens, alphas and whether the
        # logits were finite (NaN weights would decode token 0 for ever). float64 holds any id.
        packed = read_if_finite(
            torch.cat([verdict.n_accepted.view(1).double(), verdict.tokens.double(), verdict.alphas.double()]), logits)
        n = int(packed[0])
        tokens = [int(t) for t in packed[1 : n + 2]]
        # (a drafter that ranks tokens and was wrong: where does the target's token come in its order?)
        ranks = [(arm, draft.rank_at(n, tokens[n]))] if draft.ranking and n < k else []
        return Verified(accepted=n, tokens=tokens, alphas=packed[k + 2 :],
                        next_input=verdict.tokens.index_select(0, verdict.n_accepted.view(1)), width=width,
                        known_alphas={arm: verdict.alphas}, logits=logits, probs=probs, hidden=hidden,
                        kept=[(arm, n)], tree_size=k, runner_up_ranks=ranks)

    def _verify_tree(self, context: list[int], proposals: list[Proposal]) -> Verified:
        """One forward over the token tree of every proposal's chain (decoding/tree_verify.py)."""
        return verify_tree(self.target, context, proposals, self.driver.verify_width, self._verify_layers(),
                           self.settings.sampling, self.generator, self.settings.penalty)

    def _verify_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the verify hands over: the feature drafters',
        and under full information those of the drafters scored from them that this
        batch of rounds scores (`PolicyDriver.batch_skips`: each layer handed over costs
        the forward a cut and a copy, for nothing while its drafter cannot win)."""
        if not (self.hidden_layers and self.driver.full_information):
            return self.feature_layers
        scored = {layer for drafter, skipped in zip(self.drafters, self.driver.batch_skips(), strict=True)
                  if not skipped for layer in drafter.hidden_layers}
        return tuple(sorted(set(self.feature_layers) | scored))

    def _evidence(self, verified: Verified, count: int) -> RoundEvidence:
        """What evaluating the drafters on this round's `count` committed positions needs."""
        target, processed = (verified.logits, False) if verified.probs is None else (verified.probs, True)
        return RoundEvidence(verified.known_alphas, target[:count], processed,
                             {layer: h[:count] for layer, h in verified.hidden.items()})

    def _hand_over(self, position: int, hidden: dict[int, torch.Tensor], count: int) -> None:
        """The target's features at positions position .. position + count - 1 to the drafters
        that draft from them."""
        for drafter in self.feature_drafters:
            drafter.observe_features(position, {layer: hidden[layer][:count] for layer in drafter.feature_layers})

    def _commit(self, state: _Prompt, verified: Verified) -> tuple[list[int], str | None]:
        """Keep the accepted tokens: crop rejected positions from the caches, cut at EOS and
        at the budget. Returns the committed tokens and why generation ends, if it does."""
        self.target.crop(len(state.context) + verified.accepted)  # context[:-1] + last + accepted drafts
        for j, (arm, kept) in enumerate(verified.kept):  # each rolls back to its chain's committed tokens
            self.drafters[arm].on_commit(kept, judged=j == 0 or self.settings.sampling.greedy)
        # The verify fed [last committed token, accepted drafts]: their features are final.
        self._hand_over(len(state.context) - 1, verified.hidden, verified.accepted + 1)
        tokens, finish = verified.tokens, None
        for i, token in enumerate(tokens):
            if token in self.settings.eos_ids:
                tokens, finish = tokens[: i + 1], "eos"
                break
        room = state.budget - state.produced
        if len(tokens) >= room:
            tokens, finish = tokens[:room], finish or "length"
        state.context.extend(tokens)
        state.produced += len(tokens)
        state.next_input = verified.next_input
        return tokens, finish
