"""The `head` drafter kind: a trained draft head (EAGLE-style, `head_model.py`) that drafts
from the target's own features.

Every round the verify hands over the target's final feature (and, for a head trained on
fused features, the lower layers it reads) at the newly committed positions
(`feature_layers`, `observe_features`); the round never knows the kind. The head
keeps its own one-layer KV cache over pairs (f_{t-1}, x_t): "consumed up to token j" means
pairs for t = 1..j are cached. A draft catches up on the committed pairs it has not seen in
one small forward, then drafts autoregressively, feeding its own predicted feature where the
target's is not known yet. Those draft pairs are dropped after the round: the accepted
tokens' real features arrive with the next hand-over. Full-information scoring is the same
catch-up forward over committed pairs (exact: q at a committed position depends only on the
committed text and the target's features there).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

import torch

from specdraft.core.sampling import distributions, greedy_tokens
from specdraft.core.stopwatch import device_clock
from specdraft.core.verify import overlap
from specdraft.drafters.base import Draft, DraftContext, DrafterUnavailable, Hidden, PoolContext, TrajectoryScores
from specdraft.drafters.head_model import DraftHead, HeadFileError, Readout, load_head
from specdraft.drafters.model_base import ModelBackedDrafter
from specdraft.drafters.options import HeadOptions
from specdraft.errors import ProfileError
from specdraft.learning.confidence import StopRule
from specdraft.models.kernels.block_linear import BlockLinear, to_int8_blocks
from specdraft.models.kernels.formats import GROUP
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.lean.support import lean_choice
from specdraft.models.kernels.packed_linear import PackedLinear, is_packed, pack_linears, packing_problem


class HeadCache:
    """The head with its KV cache and the target features it has been handed."""

    def __init__(self, head: DraftHead, target: torch.nn.Module, logits_size: int, core: str = "auto"):
        """`core`: `[decode] drafter_core`; "auto" runs the head's layer through the lean
        forward on a CPU (transformers' one-layer forward spent most of a step outside the
        products there)."""
        self.device = next(target.parameters()).device
        self.clock = device_clock(self.device)
        self.dtype = next(target.parameters()).dtype
        self.head = head.to(self.device, self.dtype)
        self.embed = target.get_input_embeddings()
        self.readout = Readout(target, self.head.vocab_ids)
        # Where the target runs on the block kernels (its file's quantization, or bfloat16
        # weights), the head does too: its float32 products and readout moved more bytes a
        # draft step than a quarter of the quantized target's whole step.
        if self._on_blocks(target):
            to_int8_blocks(self.head)
            self.readout.on_blocks(target.get_output_embeddings())
        self.lean = LeanDecoder(self.head.body, stack=self.head.body) if lean_choice(
            core, self.head.body, self.device, stack=True) else None
        # A head drafts on its target's kernels: where the runtime packed the target for
        # oneDNN (`[decode] linear_kernel`), the head's few-row products are packed too, as
        # oneDNN streams those at close to memory bandwidth and torch's kernel does not.
        if is_packed(target) and packing_problem(self.head) is None:
            if self.lean is not None:  # the lean forward reads its own fused products
                self.lean.pack()
                for name in ("fc", "fuse"):
                    if type(getattr(self.head, name)) is torch.nn.Linear:
                        setattr(self.head, name, PackedLinear(getattr(self.head, name)))
            else:
                pack_linears(self.head)
            self.readout.pack()
        self.logits_size = logits_size
        self.hidden_size = head.config.hidden_size
        self.feature_width = self.hidden_size * len(head.config.layers_read)  # a row of hand-over
        self.reset()

    def _on_blocks(self, target: torch.nn.Module) -> bool:
        return self.device.type == "cpu" and isinstance(target.get_output_embeddings(), BlockLinear) \
            and self.head.config.hidden_size % GROUP == 0

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = None if self.lean is not None else DynamicCache(config=self.head.layer_config)
        self.length = 0  # tokens consumed: pairs for tokens 1 .. length - 1 are cached
        # The target's features at positions 0 .. known - 1, in a buffer that doubles when
        # full (a copy per round would grow with the context).
        # (not the embedding's dtype: a quantized table's `.weight` dequantizes all of it)
        self._buffer = torch.empty(256, self.feature_width, device=self.device, dtype=self.dtype)
        self.known = 0
        self.last: torch.Tensor | None = None  # [1, 1, H]: the latest predicted feature

    @property
    def features(self) -> torch.Tensor:
        return self._buffer[: self.known]

    def observe(self, position: int, rows: torch.Tensor) -> None:
        """The target's features at positions position .. position + n - 1: [n, feature_width],
        the layers the head reads side by side."""
        if position > self.known:
            raise ValueError(f"target features for position {position} handed over before those at {self.known}")
        end = position + rows.shape[0]
        if end > self._buffer.shape[0]:
            grown = self._buffer.new_empty(max(end, 2 * self._buffer.shape[0]), self.feature_width)
            grown[: self.known] = self._buffer[: self.known]
            self._buffer = grown
        self._buffer[position:end] = rows.to(self._buffer.dtype)
        self.known = end

    def crop(self, length: int) -> None:
        if length < self.length:
            pairs_kept = max(0, length - 1)
            # the lean buffer is overwritten from the next pair on
            if self.lean is None and self.cache.get_seq_length() > pairs_kept:
                self.cache.crop(pairs_kept - self.cache.get_seq_length())
            self.length = length

    @torch.inference_mode()
    def consume(self, context: Sequence[int], upto: int, keep: int) -> torch.Tensor:
        """Cache the pairs for tokens context[length:upto] and return the small (draft-vocab)
        logits after the last `keep` of them [keep, N]: row i predicts the token after it."""
        first = max(1, self.length)
        if upto > self.known + 1:
            raise ValueError(f"the head has the target's features up to position {self.known - 1} "
                             f"and was asked to consume token {upto - 1}")
        if upto <= first:
            raise ValueError("nothing to consume")
        tokens = torch.tensor(context[first:upto], dtype=torch.long, device=self.device)
        features = self.head.fused(self.features[first - 1 : upto - 1])
        out = self._forward(self.embed(tokens).view(1, -1, self.hidden_size), features.view(1, -1, self.hidden_size),
                            first - 1)
        self.length = upto
        self.last = out[:, -1:]
        return self.readout.small(out[0, -keep:])

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed a drafted token with the head's own latest prediction: small logits [1, N]."""
        out = self._forward(self.embed(token.view(1, 1).to(self.device)), self.last, self.length - 1)
        self.length += 1
        self.last = out
        return self.readout.small(out[0])

    def _forward(self, embeddings: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
        """The head over pairs at positions start.. ([1, n, H] each) after `start` cached
        ones: the predicted features [1, n, H]."""
        if self.lean is not None:
            return self.lean.hidden(self.head.inputs(embeddings, features), start)
        positions = torch.arange(start, start + embeddings.shape[1], device=self.device).view(1, -1)
        return self.head(embeddings, features, positions, self.cache)

    def widen(self, small: torch.Tensor) -> torch.Tensor:
        return self.readout.widen(small, self.logits_size)


class HeadDrafter(ModelBackedDrafter):
    """Not a causal LM transformers can assist with (`causal_lm` is None): its cost is
    measured by the round, and it times its own forward (`forward_seconds`). Nothing to
    prefill for scoring: its cache is built from the target's features, one small forward
    when it first drafts or is scored."""

    kind = "head"
    # Drafts past the first token use predicted features (scoring reads the target's real
    # features at each of them). Its scoring is a forward of its layer and readout over the
    # committed tokens: on a CPU several times a draft step's share of a target forward, so
    # it is scored only while it may be worth playing, as model drafters are.
    traits = replace(ModelBackedDrafter.traits, draft_alignment_is_score=False, later_positions_scored=False,
                     scored_by_own_forward=True)

    def __init__(self, name: str, ctx: DraftContext, head: DraftHead, target: torch.nn.Module,
                 stop_below: float | None = None, core: str = "auto"):
        self.head_cache = HeadCache(head, target, ctx.vocab_size, core)
        super().__init__(name, ctx, self.head_cache, stop_below)
        self.target = target
        self.layers_read = tuple(head.config.layers_read)

    @classmethod
    def build(cls, name: str, options: HeadOptions, pool: PoolContext, key: str, index: int) -> "HeadDrafter":
        if options.optional and not options.path.exists():
            raise DrafterUnavailable(f"no head at {options.path} (train it with `specdraft train head`)")
        try:
            head = load_head(options.path, pool.target.model)
        except HeadFileError as exc:
            raise ProfileError(pool.file, f"{key}.path", str(exc)) from None
        return cls(name, pool.draft, head, pool.target.model, options.stop_below, core=pool.drafter_core)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layers_read

    def observe_features(self, position: int, hidden: Hidden) -> None:
        self.head_cache.observe(position, self._side_by_side(hidden))

    def _side_by_side(self, hidden: Hidden) -> torch.Tensor:
        """[n, feature_width]: the hidden states of the layers the head reads, in its order."""
        if len(self.layers_read) == 1:
            return hidden[self.layers_read[0]]
        return torch.cat([hidden[layer] for layer in self.layers_read], dim=-1)

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        if len(context) < 2:  # no feature yet: the head reads the target's feature at the token before
            return self.empty_draft()
        return super().propose(context, k, stop, runner_up)

    # A draft step's logits stay over the draft vocabulary: greedy drafting takes the argmax
    # and the confidence there (the target's other tokens have q = 0), and widens them to the
    # target's vocabulary only where q or a ranking is asked for.
    def _start_draft(self, context: Sequence[int]) -> torch.Tensor:
        cache = self.head_cache
        if cache.length >= len(context):
            cache.crop(len(context) - 1)
        return cache.consume(context, len(context), keep=1)

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        return self.head_cache.step(token)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head_cache.readout.vocab_ids[greedy_tokens(logits)]

    def _wide(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head_cache.widen(logits)

    def _keep(self, n_accepted: int) -> None:
        # Draft pairs were built on predicted features: recompute them from the real ones.
        self.head_cache.crop(self._drafted_from)

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        cache = self.head_cache
        if cache.length > start - 1:
            cache.crop(start - 1)
        upto = start + count - 1
        scorable = min(count, upto - max(1, cache.length))  # position 1 has no pair before it
        gammas = target_probs.new_zeros(count)
        if scorable <= 0:
            return gammas
        logits = cache.consume(context, upto, keep=scorable)
        params = self.ctx.params
        if params.one_hot:
            # One-hot p and q: gamma is whether the token the head would draft is the one
            # committed (the target's argmax), without widening its logits to the target's
            # vocabulary and building both distributions there.
            committed = torch.tensor(context[start + count - scorable : start + count], device=logits.device)
            gammas[count - scorable:] = (self._greedy(logits) == committed).to(gammas.device, gammas.dtype)
            return gammas
        q = distributions(cache.widen(logits), params).to(target_probs.device)
        gammas[count - scorable:] = overlap(target_probs[count - scorable:], q)
        return gammas

    @torch.inference_mode()
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        """Exact: the head drafts k tokens at every generated position from the target's
        features along the trajectory (computed here with one uncached target forward)."""
        ids = torch.tensor([context], dtype=torch.long, device=self.head_cache.device)
        states = self.target(ids, output_hidden_states=True).hidden_states
        features = self._side_by_side({layer: states[layer][0] for layer in self.layers_read})
        n = len(context) - prompt_len
        scores = TrajectoryScores([], [], [], [])
        probs = target_probs
        for t in range(n):
            position = prompt_len + t
            self.reset()
            self.head_cache.observe(0, features[: position - 1])
            logits = self._start_draft(context[:position]) if position >= 2 else None
            proposal, span = [], []
            for j in range(k):
                if logits is None:
                    break
                token = self._greedy(logits)
                proposal.append(int(token))
                if t + j < n:
                    q = distributions(self._wide(logits), self.ctx.params).to(probs.device)
                    span.append(float(overlap(probs[t + j : t + j + 1], q)))
                if j < k - 1:
                    logits = self._step(token)
            r = 0
            while r < len(proposal) and t + r < n and proposal[r] == context[position + r]:
                r += 1
            scores.drafted.append(len(proposal))
            scores.run.append(r)
            scores.span.append(span)
            scores.alpha.append(span[0] if span else 0.0)
        self.reset()
        return scores

    def forward_seconds(self, widths: Sequence[int], repeats: int) -> dict[int, float]:
        """The head's forward over n pairs after 64 cached ones, on made-up features."""
        cache = self.head_cache
        length = 65 + max(widths)
        tokens = [5] * (length + 1)
        samples: dict[int, list[float]] = {w: [] for w in widths}
        clock = cache.clock
        self.reset()
        cache.observe(0, torch.randn(length, cache.feature_width, device=cache.device, dtype=cache.features.dtype))
        cache.consume(tokens, 65, keep=1)
        for _ in range(repeats):
            for width in widths:
                started = clock()
                cache.consume(tokens, 65 + width, keep=1)
                samples[width].append(clock() - started)
                cache.crop(65)
        self.reset()
        return {w: statistics.median(s) for w, s in samples.items()}
