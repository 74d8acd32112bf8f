"""The one interface every drafter kind implements, so nothing outside this package
branches on kind.

A drafter sees the committed context (token ids), proposes up to k tokens with the
distributions it drew them from (stopping early when a token is not worth its time), and
is told afterwards how many were accepted so it can roll its own state back. A
deterministic drafter returns `probs=None` (one-hot q). A kind that is scored from the
target's own hidden states names the layers it needs (`hidden_layers`); the verify forward
hands them over at the committed positions, so the round never asks which kind it runs.
Each kind's profile keys are parsed in `options.py` (torch-free); the kind builds itself (`build`),
scores itself along a finished trajectory for offline replay (`trajectory_scores`), and
says which causal LM it drafts with, if any (`causal_lm`), for cost measurement and
transformers' assisted-generation baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import torch

from specdraft.decoding.sampling import SamplingParams
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
        from specdraft.models.lean_decoder import lean_choice

        device = next(model.parameters()).device
        static, graphs = core_choice(self.kv_cache, self.cuda_graphs and not hooked, device)
        lean = not hooked and not graphs and lean_choice(self.drafter_core, model, device)
        return CachedLM(model, logits_size=self.draft.vocab_size, static=static, graphs=graphs, lean=lean)


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


def proposal_trajectory_scores(draft_at: Callable[[int], list[int]], context: Sequence[int], prompt_len: int,
                                target_probs: torch.Tensor) -> TrajectoryScores:
    """`trajectory_scores` of a deterministic drafter from what it would draft at each
    generated position (`draft_at(position)`): its run is the drafted prefix that matches
    the trajectory, its span the target's probability of each drafted token."""
    n = len(context) - prompt_len
    scores = TrajectoryScores([], [], [], [])
    for t in range(n):
        position = prompt_len + t
        proposal = draft_at(position)
        r = 0
        while r < len(proposal) and t + r < n and proposal[r] == context[position + r]:
            r += 1
        rows = [(t + j, token) for j, token in enumerate(proposal) if t + j < n]
        values = target_probs[[i for i, _ in rows], [tok for _, tok in rows]].tolist() if rows else []
        scores.drafted.append(len(proposal))
        scores.run.append(r)
        scores.span.append(values)
        scores.alpha.append(values[0] if values else 0.0)
    return scores


class Drafter(ABC):
    kind: ClassVar[str] = ""
    # True when the alignment of its draft at a position equals what `score` gives there
    # (autoregressive models: q depends only on the context). A prompt-lookup draft is one
    # lookup's whole span, so its per-position score is a fresh lookup instead.
    draft_alignment_is_score: ClassVar[bool] = False
    # True for a kind that proposes nothing where it finds nothing (lookups): a learning
    # policy then asks `proposes_at` before each round and passes over it while it is
    # silent (sleeping experts). Model drafters always propose.
    may_stay_silent: ClassVar[bool] = False

    def __init__(self, name: str, ctx: DraftContext):
        self.name = name
        self.ctx = ctx

    # --- from the profile -------------------------------------------------------------

    @classmethod
    def build(cls, name: str, options: Any, pool: PoolContext, key: str) -> "Drafter":
        """A ready drafter; `key` (e.g. "drafters[2]") names it in errors."""
        raise NotImplementedError(f"drafter kind {cls.kind!r} cannot be built from a profile")

    # --- the round -------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the previous prompt."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None) -> Draft:
        """Propose up to k tokens continuing `context` (all committed tokens, prompt included).
        `stop`: a drafter that knows how likely its next token is to be accepted stops once
        one more token no longer pays for its time (`StopRule.worth`), and may draft past k,
        up to `stop.horizon`, while it still does."""

    def prepare_scoring(self, context: Sequence[int]) -> None:
        """Full-information evaluation will score this drafter at every generated position
        after the prompt `context`: a drafter with a cache of its own prefills it now, so the
        prompt's prefill is not charged to the first round's evaluation."""

    def on_commit(self, n_accepted: int) -> None:
        """After a round this drafter drafted: `n_accepted` of its tokens were kept."""

    def end_prompt(self, context: Sequence[int]) -> None:
        """The prompt is done: `context` is it and everything generated (a drafter that
        learns from earlier text records it here)."""

    def forget_run(self) -> None:
        """Forget the text of this run's earlier prompts (a benchmark pass starts a fresh
        stream; what was loaded from disk at start stays)."""

    @abstractmethod
    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        """Full-information evaluation: gamma at committed positions start .. start+count-1 [count],
        i.e. sum_v min(p, q) with this drafter's q given context[:position]; `target_probs`
        [count, V] are the target's distributions there, `hidden` the target's hidden states
        there for the layers in `hidden_layers`. Leaves the drafter caught up to at least
        context[:start + count - 1]."""

    def proposes_at(self, context: Sequence[int], position: int) -> bool:
        """Would this drafter propose anything after context[:position]? (Model drafters
        always do; prompt lookup only when it finds a match.)"""
        return True

    def awake_at(self, context: Sequence[int], position: int) -> bool:
        """Is this drafter a candidate for a round starting after context[:position]? Only
        a kind that may stay silent is ever asleep (and the plain arm never is: it is the
        round every silent drafter would have turned into)."""
        return not self.may_stay_silent or self.proposes_at(context, position)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states `score` reads (none for most kinds)."""
        return ()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states this drafter drafts from: handed over at every
        committed position (`observe_features`), whichever arm drafted (none for most kinds)."""
        return ()

    def observe_features(self, position: int, hidden: Hidden) -> None:
        """The target's hidden states for `feature_layers` at committed positions
        position, position + 1, ... ({layer: [n, H]})."""

    def empty_draft(self) -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=self.ctx.device), None)

    # --- measurement -----------------------------------------------------------------

    @property
    def causal_lm(self) -> torch.nn.Module | None:
        """The causal LM this drafter drafts with (a draft token costs one of its forwards),
        or None when drafting happens on the host."""
        return None

    def forward_seconds(self, widths: Sequence[int], repeats: int) -> dict[int, float] | None:
        """Median seconds of one of its forwards over each number of tokens in `widths`,
        with a warm cache, for drafters that draft with a network but not a causal LM
        (`causal_lm` is None); None for the others."""
        return None

    @abstractmethod
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        """Teacher-force the finished trajectory `context` (prompt of `prompt_len` tokens, then
        the generated ones) through this drafter; `target_probs` [generated, V] are the
        target's distributions at the generated positions."""
