"""The one interface every drafter kind implements, so nothing outside this package
branches on kind.

A drafter sees the committed context (token ids), proposes up to k tokens with the
distributions it drew them from (stopping early when a token is not worth its time), and
is told afterwards how many were accepted so it can roll its own state back. A
deterministic drafter returns `probs=None` (one-hot q). `Drafter` groups its members by
the caller they serve (building, the round, evaluation, replay and measurement); what
only some kinds need lives in their bases, `LookupDrafter` (`lookup_base.py`: `ngram`,
`suffix`) and `ModelBackedDrafter` (`model_base.py`: `model`, `layers`, `steered`,
`head`). Each kind's profile keys are parsed in `options.py` (torch-free).
"""

from __future__ import annotations

import copy

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import torch

from specdraft.core.sampling import SamplingParams, rank_after, ranked_next
from specdraft.learning.confidence import StopRule

if TYPE_CHECKING:
    from specdraft.models.cached_lm import CachedLM
    from specdraft.models.loading import LoadedModel

Hidden = Mapping[int, torch.Tensor]  # {layer: [positions, H]} hidden state after that many target layers


class DrafterUnavailable(Exception):
    """An optional drafter whose files are absent: the pool is built without it."""


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] long, on the target's device; k may be smaller than asked, even 0
    probs: torch.Tensor | None  # [k, V] q_j, or None for a deterministic (one-hot) drafter
    # Seconds of the draft spent catching up on committed tokens the drafter had not seen
    # (a model idle for a while): not a cost of drafting these k tokens, so the round cost
    # model must not charge it per drafted token.
    catch_up_seconds: float = 0.0
    # A lookup's match length behind the draft (0: not a lookup, or nothing matched): how
    # sure the draft is, for a caller that calibrates acceptance by it (serving/).
    match_length: int = 0
    # Asked for with `runner_up=True` of a kind that drafts from a distribution: per drafted
    # position the scores [1, V] it ranked tokens by (greedy: its logits; sampling: q), from
    # which `runner_ups` gives the tokens it ranks after the drafted one, leaves the round
    # may verify beside the chain (EAGLE-2's top-k; see `decoding/tree_verify.py`). Kept as
    # the rows the draft made anyway: runner-ups are worked out only where a round needs them.
    ranking: tuple[torch.Tensor, ...] | None = None

    def runner_ups(self, position: int, width: int = 1) -> torch.Tensor:
        """[width] the tokens ranked after the drafted one at `position`, best first (greedy:
        the second highest logit, then the third, ...; sampling: the most likely tokens
        other than the one drawn)."""
        picked = self.tokens[position : position + 1]
        scores = self.ranking[position]
        for _ in range(width):
            picked = torch.cat([picked, ranked_next(scores, picked).to(picked.device)])
        return picked[1:]

    def leaf_tokens(self, n: int, width: int) -> torch.Tensor:
        """[min(n, k) * width] the runner-ups of the first n positions, position by position
        (none without a ranking)."""
        if not self.ranking or n <= 0 or width <= 0:
            return self.tokens.new_empty(0)
        return torch.cat([self.runner_ups(j, width) for j in range(min(n, len(self.ranking)))])

    def rank_at(self, position: int, token: int) -> int:
        """Where `token` comes after the drafted one at `position` (1: the runner-up)."""
        return rank_after(self.ranking[position], int(self.tokens[position]), token)


@dataclass(frozen=True)
class DraftContext:
    """What every drafter of one run shares: sampling rules, randomness, where the target lives."""

    params: SamplingParams
    generator: torch.Generator | None
    device: torch.device
    vocab_size: int  # width of the target's logits


@dataclass(frozen=True)
class PoolContext:
    """What building a drafter may need besides its own options."""

    draft: DraftContext
    target: "LoadedModel"
    target_lm: "CachedLM"  # the target with the KV cache the round verifies with
    file: str  # the profile, for error messages
    seed: int  # the run's seed; model drafters on another device derive their own generator from it
    # Models already loaded in this process, by spec: runtimes built side by side (bench's
    # policies) share one copy of each drafter's weights instead of loading it once each.
    models: dict = field(default_factory=dict)
    kv_cache: str = "auto"  # [decode] kv_cache and cuda_graphs, for the drafters' own caches
    cuda_graphs: bool = True
    drafter_core: str = "auto"  # [decode] drafter_core: "auto", "lean" or "transformers"
    # Whether drafters may write what they learn to disk (the learned suffix store). bench and
    # trace measure: each pass must see the store as it was at the start, and leave it so.
    record: bool = True

    def load(self, spec: Any, key: str) -> "LoadedModel":
        """The model of `spec`, loaded once per pool context (weights are only read)."""
        from specdraft.models.loading import load_model

        return self.shared(spec, lambda: load_model(spec, self.file, key))

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, once per pool context and `key` (what runtimes side by side may share)."""
        if key not in self.models:
            self.models[key] = make()
        return self.models[key]

    def cached_lm(self, model: torch.nn.Module, hooked: bool = False) -> "CachedLM":
        """A drafter's own model with its own cache, of the kind the run asked for.
        `hooked`: the model's forward hooks change tensors between calls, which neither a
        captured CUDA graph nor the lean forward would see: transformers' forward it is."""
        from specdraft.models.cached_lm import CachedLM
        from specdraft.models.kv_cache import core_choice
        from specdraft.models.lean.support import lean_choice

        device = next(model.parameters()).device
        static, graphs = core_choice(self.kv_cache, self.cuda_graphs and not hooked, device)
        lean = not hooked and not graphs and lean_choice(self.drafter_core, model, device)
        return CachedLM(model, logits_size=self.draft.vocab_size, static=static, graphs=graphs, lean=lean)


@dataclass(frozen=True)
class DrafterTraits:
    """What a drafter kind is, as the engine, the evaluator, the planner and a serving engine
    ask it: one object per class (`Drafter.traits`), a subclass's a `replace` of its parent's."""

    may_sleep: bool = False  # may propose nothing at a position (a lookup that finds nothing)
    # Whether a serving engine that owns the target (serving/) can run this kind as its
    # proposer: only a kind that drafts from token ids alone; `engine_problem` says why not.
    token_ids_only: bool = False
    engine_problem: str = "reads the target's hidden states or KV cache, which the serving engine owns"
    # True when the alignment of its draft at a position equals what `score` gives there
    # (autoregressive models: q depends only on the context), so the evaluator reuses it. A
    # lookup's draft is one lookup's whole span: its per-position score is a fresh lookup.
    draft_alignment_is_score: bool = False
    # False when `score` at a committed position says how the drafter's first draft token
    # would do there but not how a draft does further on (a head drafts on from its own
    # predicted features, a steered block steers its later tokens from its start): the
    # planner then learns its acceptance past the first position from its own drafts only.
    later_positions_scored: bool = True
    # Whether scoring it runs a forward of its own over every committed token it did not
    # draft (a model with a cache of its own): the planner scores such a drafter only while
    # it may be worth playing. A trace without the record asks the kind.
    scored_by_own_forward: bool = False
    drafts_nothing: bool = False  # the plain arm: every round it plays is a plain decoding round


@dataclass
class TrajectoryScores:
    """A drafter teacher-forced along a finished greedy trajectory, per generated position t:
    `alpha[t]` its gamma at t (what full-information evaluation scores), `drafted[t]` how many
    tokens it would draft there, `run[t]` how many of them match the trajectory (its accepted
    run under greedy), `span[t]` the alignment of each drafted position."""

    alpha: list[float]
    drafted: list[int]
    run: list[int]
    span: list[list[float]]


class Drafter(ABC):
    """One drafter of the pool. Only `propose`, `score` and `trajectory_scores` must be
    written; every other member defaults to what a kind that needs none of it does.

    What the round, the evaluator and a serving engine need to know of a kind, beyond its
    methods, is its `traits`. A drafter is *awake* at a position when it would propose
    something there. A kind that may sleep (`traits.may_sleep`: a lookup that finds nothing proposes nothing) is asked before
    each round (`awake_at`), and a learning policy chooses among the awake arms (sleeping
    experts, Freund et al. 1997). Model-backed drafters and the plain arm never sleep."""

    kind: ClassVar[str] = ""
    traits: ClassVar[DrafterTraits] = DrafterTraits()

    def __init__(self, name: str, ctx: DraftContext):
        self.name = name
        self.ctx = ctx

    # --- building (drafters/registry.py) -----------------------------------------------

    @classmethod
    def build(cls, name: str, options: Any, pool: PoolContext, key: str, index: int) -> "Drafter":
        """A ready drafter from its profile `options`; `key` (e.g. "drafters[2]") names it in
        errors, `index` is its place in the pool."""
        raise NotImplementedError(f"drafter kind {cls.kind!r} cannot be built from a profile")

    # --- the round (decoding/engine.py) ------------------------------------------------

    def reset(self) -> None:
        """Forget the previous prompt."""

    def fork(self) -> "Drafter":
        """A drafter for one more prompt decoded beside this one (a serving engine's
        requests): what the drafter keeps per prompt is its own, what it learned from
        earlier text (stores, the history of answers) is shared."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        """Propose up to k tokens continuing `context` (all committed tokens, prompt included).
        `stop`: a drafter that knows how likely its next token is to be accepted stops once
        one more token no longer pays for its time (`StopRule.worth`), and may draft past k,
        up to `stop.horizon`, while it still does. `runner_up`: also keep what each
        position's next-ranked token can be read from (`Draft.ranking`), where the kind ranks
        tokens (the others ignore it)."""

    def on_commit(self, n_accepted: int, judged: bool = True) -> None:
        """After a round this drafter drafted: `n_accepted` of its tokens were kept.
        `judged` is False for a tree's branch: under sampling its tokens were tried after
        other chains' (or not at all), so the count says nothing of how likely each was."""

    def end_prompt(self, context: Sequence[int]) -> None:
        """The prompt is done: `context` is it and everything generated (a drafter that
        learns from earlier text records it here)."""

    def committed_scores(self, context: Sequence[int], start: int, count: int) -> list[float]:
        """Gamma at context[start:start + count] when only the committed tokens are known (a
        serving engine keeps the target's distribution to itself): 1 where this drafter's
        fresh proposal there is the committed token. Under greedy decoding that is the
        exact acceptance; under sampling an unbiased estimate of p(proposal). Only kinds
        that are `token_ids_only` can say it."""
        raise NotImplementedError(f"drafter kind {self.kind!r} is scored from the target's distribution")

    def awake_at(self, context: Sequence[int], position: int) -> bool:
        """Would this drafter propose anything after context[:position]? Asked only of a
        kind that `may_sleep`."""
        return True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states this drafter drafts from: handed over at every
        committed position (`observe_features`), whichever arm drafted."""
        return ()

    def observe_features(self, position: int, hidden: Hidden) -> None:
        """The target's hidden states for `feature_layers` at committed positions
        position, position + 1, ... ({layer: [n, H]})."""

    def empty_draft(self) -> Draft:
        """No tokens (a round planned at K = 0, or nothing worth drafting)."""
        return Draft(torch.empty(0, dtype=torch.long, device=self.ctx.device), None)

    # --- evaluation under full information (decoding/evaluation.py) ----------------------

    @abstractmethod
    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        """Gamma at committed positions start .. start+count-1 [count], i.e. sum_v min(p, q)
        with this drafter's q given context[:position]; `target_probs` [count, V] are the
        target's distributions there, `hidden` the target's hidden states there for the
        layers in `hidden_layers`. Leaves the drafter caught up to at least
        context[:start + count - 1]."""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states `score` reads (the verify forward returns them)."""
        return ()

    def prepare_scoring(self, context: Sequence[int]) -> None:
        """Every generated position after the prompt `context` will be scored: a drafter with
        a cache of its own prefills it now, so the prompt's prefill is not charged to the
        first round's evaluation."""

    # --- replay and measurement (measurement/) ------------------------------------------

    @abstractmethod
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        """Teacher-force the finished trajectory `context` (prompt of `prompt_len` tokens, then
        the generated ones) through this drafter; `target_probs` [generated, V] are the
        target's distributions at the generated positions."""

    @property
    def causal_lm(self) -> torch.nn.Module | None:
        """The causal LM this drafter drafts with (a draft token costs one of its forwards:
        traces time it, bench uses it as transformers' assistant), or None."""
        return None

    def forward_seconds(self, widths: Sequence[int], repeats: int) -> dict[int, float] | None:
        """Median seconds of one of its forwards over each number of tokens in `widths`,
        with a warm cache, for drafters that draft with a network but not a causal LM
        (`causal_lm` is None); None for the others."""
        return None

    def forget_run(self) -> None:
        """Forget the text of this run's earlier prompts (a benchmark pass starts a fresh
        stream; what was loaded from disk at start stays)."""
