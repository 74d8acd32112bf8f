"""What a steered drafter learns (`specdraft train steer`, SD2 Fig. 3): the pretrained
drafter, with per-layer MLP biases from a steering vector of the target's hidden states,
matches the target's next-token distribution: loss = KL(target || drafter) at every
position of teacher-forced sequences whose next token belongs to an answer or plain text,
not to a chat prompt (the drafter never drafts a prompt; the paper's code masks its
synthetic data's prompts the same way).

The drafter predicting token t is steered from the target's states at position t - d,
with d drawn uniformly per position from [2, K + 1]: when it drafts, the latest verified
position is two before its first drafted token (the token in between is the verify's own)
and K + 1 before its last. (The paper counts delta in [1, K] from the token the verify
produced; this is the same block.) Positions with no state d tokens back are left out of
the loss. The target's distribution is its head over its final (post-norm) state, computed
per batch from the stored features, so the corpus stores hidden states only.

`steering = False` trains the distilled baseline: the same data, steps and KL, no steering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdraft.drafters.steering import FIRST_OFFSET, Steering, SteeringHooks
from specdraft.training.features import FeatureSet, RowBatches


@dataclass
class SteerTrainingSettings:
    batch_sequences: int = 2
    max_draft: int = 5  # K: offsets are drawn from [2, K + 1]
    steering: bool = True
    bf16: bool = True  # autocast the drafter's forward (master weights and the loss stay float32)
    seed: int = 0


def draw_offsets(batch: int, length: int, max_draft: int, rng: np.random.Generator) -> np.ndarray:
    """d for every prediction [batch, length]: uniform in [2, max_draft + 1]."""
    return rng.integers(FIRST_OFFSET, max_draft + 2, size=(batch, length))


def source_positions(offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """For the drafter's prediction at every input index i (of token i + 1) with offset d:
    the index of the target state it is steered from, i + 1 - d, clamped to 0 ([batch,
    length] long), and whether that state exists ([batch, length] bool)."""
    source = np.arange(offsets.shape[-1])[None, :] + 1 - offsets
    return torch.from_numpy(np.maximum(source, 0)), torch.from_numpy(source >= 0)


def predicted_mask(data: FeatureSet, rows: np.ndarray) -> torch.Tensor:
    """[B, T] bool: whether the token each input position predicts (the next one) is one to
    learn; the last position predicts past its sequence and counts as its own token does.
    """
    mask = data.learned(rows)
    return torch.from_numpy(np.concatenate([mask[:, 1:], mask[:, -1:]], axis=1))


class SteerObjective:
    """Batches from a FeatureSet (the three steering layers, then the final state) and the
    steered drafter's loss on them."""

    def __init__(self, drafter: torch.nn.Module, steering: Steering, head_weight: torch.Tensor, data: FeatureSet,
                 settings: SteerTrainingSettings, train_rows: np.ndarray, device: torch.device):
        self.drafter, self.steering, self.data, self.settings = drafter, steering, data, settings
        self.head_weight = head_weight  # the target's output head [V, H], for its distributions
        self.hooks = SteeringHooks(drafter) if settings.steering else None
        self.layers = steering.config.layers
        self.final = max(data.features)
        self.batches = RowBatches(train_rows, settings.batch_sequences, settings.seed)
        self.device = device
        self.generator = np.random.default_rng(settings.seed + 1)  # the offsets

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = np.sort(rows)
        tokens = torch.from_numpy(self.data.tokens[rows].astype(np.int64)).to(self.device)
        states = torch.stack([torch.from_numpy(np.asarray(self.data.features[layer][rows], dtype=np.float32))
                              for layer in self.layers], dim=2)  # [B, T, 3, H]
        final = torch.from_numpy(np.asarray(self.data.features[self.final][rows], dtype=np.float32))
        return tokens, states.to(self.device), final.to(self.device), predicted_mask(self.data, rows).to(self.device)

    def loss(self, tokens: torch.Tensor, states: torch.Tensor, final: torch.Tensor, learned: torch.Tensor,
             offset: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """KL at every position whose steering state exists and whose next token is one to
        learn (`learned`, [B, T] bool); `offset` fixes d (evaluation)."""
        batch, length = tokens.shape
        offsets = draw_offsets(batch, length, self.settings.max_draft, self.generator) if offset is None \
            else np.full((batch, length), offset)
        logits, valid = self.steered_logits(tokens, states, offsets)
        valid = valid & learned
        with torch.no_grad():
            target_logits = F.linear(final, self.head_weight.float())
        width = min(logits.shape[-1], target_logits.shape[-1])  # a drafter with a padded vocabulary
        log_p = F.log_softmax(target_logits[..., :width], dim=-1)
        log_q = F.log_softmax(logits[..., :width].float(), dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        weight = valid.float()
        loss = (kl * weight).sum() / weight.sum().clamp_min(1.0)
        agree = ((log_q.argmax(-1) == log_p.argmax(-1)).float() * weight).sum() / weight.sum().clamp_min(1.0)
        return loss, {"kl": float(loss.detach()), "top1": float(agree)}

    def steered_logits(self, tokens: torch.Tensor, states: torch.Tensor, offsets: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's logits [B, T, V] with input i steered from the state at i + 1 - d
        (d = offsets[b, i]), and which positions have that state ([B, T] bool; all of them
        for the distilled drafter, which is not steered)."""
        source, valid = source_positions(offsets)
        source, valid = source.to(self.device), valid.to(self.device)
        if self.hooks is not None:
            picked = states[torch.arange(tokens.shape[0], device=self.device)[:, None], source]  # [B, T, 3, H]
            self.hooks.bias = self.steering(picked) * valid[..., None, None]
        else:
            valid = torch.ones_like(valid)
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.bf16):
                return self.drafter(tokens).logits, valid
        finally:
            if self.hooks is not None:
                self.hooks.bias = None

    def step(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(*self.batch(self.batches.next()))

    @torch.no_grad()
    def evaluate(self, rows: np.ndarray) -> dict[str, float]:
        """Held-out KL and top-1 agreement for the first drafted token of a block (d = 2) and
        the last (d = K + 1)."""
        self.drafter.eval()
        last = self.settings.max_draft + 1
        totals, batches = {"kl": 0.0, "top1": 0.0, "kl@last": 0.0, "top1@last": 0.0}, 0
        for first in range(0, len(rows), self.settings.batch_sequences):
            batch = self.batch(rows[first : first + self.settings.batch_sequences])
            _, near = self.loss(*batch, offset=FIRST_OFFSET)
            _, far = self.loss(*batch, offset=last)
            totals["kl"] += near["kl"]
            totals["top1"] += near["top1"]
            totals["kl@last"] += far["kl"]
            totals["top1@last"] += far["top1"]
            batches += 1
        self.drafter.train()
        return {key: value / max(1, batches) for key, value in totals.items()}
