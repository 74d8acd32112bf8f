"""What a draft head learns (`specdraft train head`): from the target's final feature f_t
and the next token x_{t+1}, predict f_{t+1}; loss = KL(target || head) on the token after
(over the draft vocabulary, both read out by the target's own head rows) plus a smooth-L1
pull of the predicted feature toward the real one (EAGLE: the regression keeps the
prediction usable as the next step's input). Input features get a little noise, and with
`unroll = 2` the head also learns the second draft step from its own prediction, so it
tolerates its own slightly-wrong features when it drafts several tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdraft.drafters.head_model import DraftHead, HeadConfig, Readout
from specdraft.training.features import FeatureSet, RowBatches


@dataclass
class HeadTrainingSettings:
    batch_sequences: int = 8
    regression_weight: float = 1.0
    noise: float = 0.05  # std of input-feature noise, relative to the features' RMS
    unroll: int = 1  # 2: also train the second draft step on the head's own prediction
    seed: int = 0


def draft_vocabulary(tokens: np.ndarray, size: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent tokens of the corpus (plus `always`, e.g. end-of-turn ids),
    sorted by id; every id when `size` covers the vocabulary."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = np.bincount(tokens.reshape(-1), minlength=vocab_size)[:vocab_size].astype(np.float64)
    counts[[t for t in always if 0 <= t < vocab_size]] = np.inf
    chosen = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(chosen)).long()


class HeadObjective:
    """Batches from a FeatureSet and the head's loss on them."""

    def __init__(self, head: DraftHead, target: torch.nn.Module, data: FeatureSet, layer: int,
                 settings: HeadTrainingSettings, train_rows: np.ndarray, device: torch.device):
        self.head, self.data, self.layer, self.settings = head, data, layer, settings
        self.batches = RowBatches(train_rows, settings.batch_sequences, settings.seed)
        self.device = device
        self.embed = target.get_input_embeddings()
        self.readout = Readout(target, head.vocab_ids)
        sample = np.asarray(data.features[layer][train_rows[: min(len(train_rows), 16)]], dtype=np.float32)
        self.feature_rms = float(np.sqrt((sample ** 2).mean()))

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.from_numpy(self.data.tokens[np.sort(rows)].astype(np.int64)).to(self.device)
        features = torch.from_numpy(np.asarray(self.data.features[self.layer][np.sort(rows)], dtype=np.float32))
        return tokens, features.to(self.device)

    def loss(self, tokens: torch.Tensor, features: torch.Tensor, noise: bool = True, unroll: int | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss over every pair (f_t, x_{t+1}) -> (f_{t+1}, p_{t+1}) of the batch; with
        `unroll` 2, also over (predicted f_t, x_{t+1}) -> (f_{t+1}, p_{t+1}): the second
        drafted token, read from the head's own prediction as when it drafts."""
        unroll = self.settings.unroll if unroll is None else unroll
        length = tokens.shape[1]
        inputs = features[:, :-1]
        if noise and self.settings.noise > 0:
            inputs = inputs + torch.randn_like(inputs) * (self.settings.noise * self.feature_rms)
        with torch.no_grad():
            embeddings = self.embed(tokens[:, 1:]).float()
            goal = features[:, 1:]
            log_p = F.log_softmax(self.readout.small(goal).float(), dim=-1)
        positions = torch.arange(length - 1, device=tokens.device).expand(tokens.shape[0], -1)
        loss, metrics = torch.zeros((), device=tokens.device), {}
        for depth in range(1, unroll + 1):
            predicted = self.head(embeddings, inputs, positions)
            log_q = F.log_softmax(self.readout.small(predicted).float(), dim=-1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
            regression = F.smooth_l1_loss(predicted.float(), goal)
            loss = loss + (kl + self.settings.regression_weight * regression) / unroll
            suffix = "" if depth == 1 else f"@{depth}"
            metrics["kl" + suffix] = float(kl.detach())
            metrics["top1" + suffix] = float((log_q.argmax(-1) == log_p.argmax(-1)).float().mean())
            # The next depth: each pair's feature is the prediction made one position earlier.
            inputs, embeddings, goal, log_p = predicted[:, :-1], embeddings[:, 1:], goal[:, 1:], log_p[:, 1:]
            positions = positions[:, 1:]
        return loss, metrics

    def step(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        # bf16 autocast on a GPU (the master weights and the loss stay float32); a CPU
        # trains in float32, where bf16 gained only ~1.3x here.
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return self.loss(*self.batch(self.batches.next()))

    @torch.no_grad()
    def evaluate(self, rows: np.ndarray) -> dict[str, float]:
        """Mean KL and top-1 agreement on `rows` (held out), without noise."""
        self.head.eval()
        totals, batches = {"kl": 0.0, "top1": 0.0, "kl@2": 0.0, "top1@2": 0.0}, 0
        for first in range(0, len(rows), self.settings.batch_sequences):
            _, metrics = self.loss(*self.batch(rows[first : first + self.settings.batch_sequences]), noise=False,
                                   unroll=2)
            for key in totals:
                totals[key] += metrics[key]
            batches += 1
        self.head.train()
        return {key: value / max(1, batches) for key, value in totals.items()}


def new_head(target: torch.nn.Module, vocab_ids: torch.Tensor) -> DraftHead:
    # float32 master weights whatever torch's default dtype is (a float64 load may leave it changed)
    head = DraftHead(HeadConfig.for_target(target, int(vocab_ids.numel()))).float()
    head.vocab_ids = vocab_ids.clone()
    head.init_from_target(target)
    return head
