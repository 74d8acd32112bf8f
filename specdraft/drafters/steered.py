"""The `steered` drafter kind (SD2): a pretrained small model steered by the target.

After every verify the round hands over the target's hidden states at the three steering
layers for the newly committed positions (`feature_layers`; the round does not know
kinds). A block is drafted with the biases computed from the latest of them: the last
position the target has verified, two tokens before the first drafted one (the token
between is the one the verify itself produced, whose features come with the next verify).
So a block's j-th drafted token is steered from j + 2 positions back, as training draws
its offsets (training/steer.py).

Committed tokens the drafter's cache has not seen (the prompt, the verify's own token,
whatever full-information scoring feeds) are steered each from its own position, two
back, never from a later one: training only ever steers a position from its past, so a
prompt fed under the block's biases would put states the trained drafter never saw
into every later draft's attention. Everything else is the `model` kind's
(`model_base.py`, `CausalLMDrafter`).

A round projects the steering once: the last committed token is steered from the latest
verified state, which is the block's, so the catch-up's last row is the block's bias
(computed lazily when there is no catch-up). Where bf16 matmuls are native the projection
runs on a bf16 copy of the steering, since it reads all of the steering's weights.

A steering folder written with `--no-steering` holds a distilled drafter (the paper's
baseline): trained weights, no steering. One written with `--freeze-drafter` holds no
drafter weights, so the drafter is the pool's copy of the pretrained model, shared with a
`model` drafter of the same file.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Sequence

import torch

from specdraft.drafters.base import Draft, DraftContext, DrafterUnavailable, Hidden, PoolContext, TrajectoryScores
from specdraft.drafters.model_base import CausalLMDrafter
from specdraft.drafters.options import SteeredOptions
from specdraft.drafters.steering import (FIRST_OFFSET, Steering, SteeringFileError, SteeringHooks, load_steering,
                                         read_steering_config)
from specdraft.errors import ProfileError
from specdraft.learning.confidence import StopRule
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import native_bf16


# Committed tokens fed per forward while steering each from its own position: 64 positions
# of per-layer biases are ~30 MB on Qwen2.5-0.5B (24 layers x 4864 units, float32).
CONTEXT_CHUNK = 64


class SteeredDrafter(CausalLMDrafter):
    kind = "steered"
    # A block's later tokens are steered from its start (scoring steers each position from its own).
    traits = replace(CausalLMDrafter.traits, draft_alignment_is_score=False, later_positions_scored=False)
    lm: CachedLM

    def __init__(self, name: str, ctx: DraftContext, model: torch.nn.Module, steering: Steering,
                 target: torch.nn.Module, stop_below: float | None = None, lm: CachedLM | None = None):
        super().__init__(name, ctx, lm if lm is not None else CachedLM(model, logits_size=ctx.vocab_size), stop_below)
        weight = next(model.parameters())
        self.steering = steering.to(weight.device)
        if weight.dtype != torch.float64 and native_bf16(weight.device) \
                and self.steering.w_s.weight.dtype == torch.float32:
            # Each round's projection reads the whole of W_s, so it runs at half the bytes
            # where bf16 is native (training adds the biases in bf16 there anyway, under
            # autocast). A copy: the loaded steering may be shared.
            self.steering = copy.deepcopy(self.steering).to(torch.bfloat16)
        self.hooks = SteeringHooks(model) if steering.config.steering else None
        self.target = target
        self._latest_at = -1  # the last verified position handed over (-1: none yet)
        # [positions, 3, H]: the steering layers at every verified position of this prompt
        # (rows past `_verified` are spare room), for steering committed tokens one by one.
        self._states: torch.Tensor | None = None
        self._verified = 0

    @classmethod
    def build(cls, name: str, options: SteeredOptions, pool: PoolContext, key: str,
              index: int) -> "SteeredDrafter":
        from specdraft.models.loading import check_tokenizers, load_model

        if options.optional and not options.steering.exists():
            raise DrafterUnavailable(f"no steering at {options.steering} (train it with `specdraft train steer`)")
        try:
            if read_steering_config(options.steering).drafter_trained:
                # Its own copy of the pretrained model: trained weights replace the pretrained
                # ones, so it is shared only with steered drafters of the same folder.
                loaded, steering = pool.shared(("steered", options.model, options.steering),
                                               lambda: _load(options, pool, key, load_model))
            else:
                # Steering only (`--freeze-drafter`): the pool's one copy of the pretrained
                # model, shared with a `model` drafter of the same file. The hooks add nothing
                # while no bias is set, and one is set only while this drafter drafts or scores.
                loaded = pool.load(options.model, key)
                steering = pool.shared(("steering", options.model, options.steering),
                                       lambda: load_steering(options.steering, pool.target.model, loaded.model))
        except SteeringFileError as exc:
            raise ProfileError(pool.file, f"{key}.steering", str(exc)) from None
        check_tokenizers(pool.target, loaded, pool.file, key)
        return cls(name, pool.draft, loaded.model, steering, pool.target.model, options.stop_below,
                   lm=pool.cached_lm(loaded.model, hooked=True))  # the biases change every block

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.steering.config.layers))) if self.hooks is not None else ()

    def observe_features(self, position: int, hidden: Hidden) -> None:
        states = torch.stack([hidden[layer] for layer in self.steering.config.layers], dim=1)  # [n, 3, H]
        end = position + states.shape[0]
        if self._states is None or self._states.shape[0] < end:
            grown = states.new_zeros((max(2 * end, 256), *states.shape[1:]))
            if self._states is not None:
                grown[: self._verified] = self._states[: self._verified]
            self._states = grown
        self._states[position:end] = states
        self._verified = max(self._verified, end)
        self._latest_at = end - 1

    @property
    def latest(self) -> torch.Tensor | None:
        """[3, H]: the steering layers at the last verified position handed over."""
        return None if self._latest_at < 0 else self._states[self._latest_at]

    def reset(self) -> None:
        super().reset()
        self._latest_at = -1
        self._verified = 0

    def _feed_context(self, context: Sequence[int], end: int, keep: int = 1) -> torch.Tensor:
        """Committed tokens, each steered from two positions back (zero where no verified
        state is there: the first token, as in training), in chunks that bound the
        per-position biases' memory ([chunk, layers, intermediate] floats)."""
        if self.hooks is None:
            return super()._feed_context(context, end, keep)
        hooks, start = self.hooks, self.lm.length
        block_bias, block_pending = hooks.bias, hooks.pending
        first_kept = start if keep == 0 else end - keep
        kept, biases = [], None
        try:
            hooks.pending = None
            for chunk_start in range(start, end, CONTEXT_CHUNK):
                chunk_end = min(end, chunk_start + CONTEXT_CHUNK)
                hooks.bias = biases = self._position_biases(chunk_start, chunk_end)
                wanted = chunk_end - max(first_kept, chunk_start)  # of this chunk's logits
                logits = super()._feed_context(context, chunk_end, keep=max(1, wanted))
                if wanted > 0:
                    kept.append(logits)
        finally:
            hooks.bias, hooks.pending = block_bias, block_pending
        # The last committed token is steered from the latest verified state, which is the
        # block's: its row is the block's bias, so a round reads the steering's weights
        # (~120 MB on Qwen2.5-0.5B) once, not twice.
        if block_pending is not None and biases is not None and end - FIRST_OFFSET == self._latest_at:
            hooks.bias, hooks.pending = biases[0, -1], None
        return torch.cat(kept)

    @torch.inference_mode()
    def _position_biases(self, start: int, end: int) -> torch.Tensor | None:
        """[1, end - start, layers, intermediate]: input position i steered from the verified
        state at i + 1 - FIRST_OFFSET; None when no position has one."""
        sources = torch.arange(start + 1 - FIRST_OFFSET, end + 1 - FIRST_OFFSET)
        valid = (sources >= 0) & (sources < self._verified)
        if self._states is None or not bool(valid.any()):
            return None
        picked = self._states[sources.clamp(0, self._verified - 1)].to(self.lm.device)
        biases = self.steering(picked) * valid.to(self.lm.device)[:, None, None]
        return biases.unsqueeze(0)

    def propose(self, context: Sequence[int], k: int, stop: StopRule | None = None,
                runner_up: bool = False) -> Draft:
        with self.steering_on():
            return super().propose(context, k, stop, runner_up)

    def prepare_scoring(self, context: Sequence[int]) -> None:
        with self.steering_on():
            super().prepare_scoring(context)

    def score(self, context: Sequence[int], start: int, count: int, target_probs: torch.Tensor,
              hidden: Hidden | None = None) -> torch.Tensor:
        with self.steering_on():
            return super().score(context, start, count, target_probs, hidden)

    @torch.inference_mode()
    def trajectory_scores(self, context: list[int], prompt_len: int, target_probs: torch.Tensor,
                          k: int) -> TrajectoryScores:
        """Approximate for replay: every position steered at the first draft token's offset
        (a live block steers its later tokens from its start, and its cache holds what
        earlier blocks' biases computed)."""
        if self.hooks is None:
            return super().trajectory_scores(context, prompt_len, target_probs, k)
        ids = torch.tensor([context], dtype=torch.long, device=next(self.target.parameters()).device)
        out = self.target(ids, output_hidden_states=True)
        self.observe_features(0, {layer: out.hidden_states[layer][0] for layer in self.feature_layers})
        self.hooks.bias = self._position_biases(0, len(context))  # kept through the reset below
        try:
            return super().trajectory_scores(context, prompt_len, target_probs, k)
        finally:
            self.hooks.bias = None

    def steering_on(self):
        """A context in which the shared small model's gate projections carry this drafter's
        biases (and only then: a `model` drafter over the same weights stays unsteered)."""
        return _Biased(self)

    @torch.inference_mode()
    def block_bias(self) -> torch.Tensor:
        """[layers, intermediate]: the biases a block is drafted with."""
        return self.steering(self.latest.to(self.lm.device))


class _Biased:
    """While drafting or scoring: the biases of the latest verified position (none before
    the first verify has handed any over), computed lazily."""

    def __init__(self, drafter: SteeredDrafter):
        self.drafter = drafter

    def __enter__(self) -> None:
        d = self.drafter
        if d.hooks is not None and d.latest is not None:
            # Computed by the first forward that needs it, unless a catch-up hands it over.
            d.hooks.pending = d.block_bias

    def __exit__(self, *exc) -> None:
        if self.drafter.hooks is not None:
            self.drafter.hooks.bias = self.drafter.hooks.pending = None


def _load(options: SteeredOptions, pool: PoolContext, key: str, load_model):
    loaded = load_model(options.model, pool.file, key)
    return loaded, load_steering(options.steering, pool.target.model, loaded.model)
