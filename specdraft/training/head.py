"""What a draft head learns (`specdraft train head`): from the target's final feature f_t
and the next token x_{t+1}, predict f_{t+1}; loss = KL(target || head) on the token after
(over the draft vocabulary, both read out by the target's own head rows) plus a smooth-L1
pull of the predicted feature toward the real one (EAGLE: the regression keeps the
prediction usable as the next step's input). Input features get a little noise, and with
`unroll = n` the head also learns draft steps 2..n from its own predictions (EAGLE-3's
training-time test), so it tolerates its own slightly-wrong features when it drafts
several tokens: step a at position p attends to the real pairs up to p - a + 1 and to its
own steps since, as its cache holds them when it drafts (`drafting_mask`). Only tokens a
drafter will draft count: the prompts of chat exchanges are left out of the loss (the
answer mask of the feature set), as `train steer` does.
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
    unroll: int = 1  # n > 1: also train draft steps 2..n on the head's own predictions
    bf16: bool = False  # autocast the head's products (master weights and the loss stay float32)
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
    """Batches from a FeatureSet (the layers the head reads, the final feature last) and the
    head's loss on them."""

    def __init__(self, head: DraftHead, target: torch.nn.Module, data: FeatureSet, layer: int,
                 settings: HeadTrainingSettings, train_rows: np.ndarray, device: torch.device):
        """`layer`: the final feature's (the target's layer count), which every head predicts."""
        self.head, self.data, self.layer, self.settings = head, data, layer, settings
        self.layers = head.config.layers_read
        if self.layers[-1] != layer:
            raise ValueError(f"the head reads layers {self.layers}; the last must be the final feature {layer}")
        self.batches = RowBatches(train_rows, settings.batch_sequences, settings.seed)
        self.device = device
        self.embed = target.get_input_embeddings()
        self.readout = Readout(target, head.vocab_ids)
        self.target = target
        sample = np.asarray(data.features[layer][train_rows[: min(len(train_rows), 16)]], dtype=np.float32)
        self.feature_rms = float(np.sqrt((sample ** 2).mean()))

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = np.sort(rows)
        tokens = torch.from_numpy(self.data.tokens[rows].astype(np.int64)).to(self.device)
        features = torch.cat([torch.from_numpy(np.asarray(self.data.features[layer][rows], dtype=np.float32))
                              for layer in self.layers], dim=-1)  # [B, T, layers * H]
        return tokens, features.to(self.device), torch.from_numpy(self.data.learned(rows)).to(self.device)

    def loss(self, tokens: torch.Tensor, features: torch.Tensor, learned: torch.Tensor, noise: bool = True,
             unroll: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics, _ = self.weighed_loss(tokens, features, learned, noise, unroll)
        return loss, metrics

    def weighed_loss(self, tokens: torch.Tensor, features: torch.Tensor, learned: torch.Tensor, noise: bool = True,
                     unroll: int | None = None) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """Loss over every pair (f_t, x_{t+1}) -> (f_{t+1}, p_{t+1}) of the batch whose
        predicted token x_{t+2} is one to learn (`learned`, [B, T] bool per token); with
        `unroll` n, also over (predicted f_t, x_{t+1}) -> (f_{t+1}, p_{t+1}) at depths 2..n:
        the later drafted tokens, read from the head's own predictions as when it drafts.
        Also returns how many learned pairs each depth's metrics average over."""
        unroll = self.settings.unroll if unroll is None else unroll
        length = tokens.shape[1]
        if length < 2:  # no pair to learn from
            return torch.zeros((), device=tokens.device), {}, {}
        inputs = self.head.fused(features[:, :-1])
        if noise and self.settings.noise > 0:
            inputs = inputs + torch.randn_like(inputs) * (self.settings.noise * self.feature_rms)
        with torch.no_grad():
            embeddings = self.embed(tokens[:, 1:]).float()
            goal = features[:, 1:, -self.head.config.hidden_size:]  # the final feature
            # pair t predicts token t + 2; the last pair's token lies past the sequence and
            # counts as the sequence's last token does
            learned_pairs = torch.cat([learned[:, 2:], learned[:, -1:]], dim=1)  # [B, T - 1] bool
            # Read out only the pairs that count (a chat prompt's are a third of a batch):
            # the draft-vocabulary products are most of a step. Depth d's pair j stands at
            # position j + d - 1 of depth 1, so every depth's goals are among depth 1's.
            log_p = F.log_softmax(self.readout.small(goal[learned_pairs]).float(), dim=-1)
            column = torch.arange(length - 1, device=tokens.device).expand_as(learned_pairs)
        positions = torch.arange(length - 1, device=tokens.device).expand(tokens.shape[0], -1)
        loss, metrics, counts = torch.zeros((), device=tokens.device), {}, {}
        for depth, predicted in enumerate(self.depth_predictions(embeddings, inputs, positions, unroll), start=1):
            chosen = learned_pairs[:, depth - 1 :]
            p_rows = log_p if depth == 1 else log_p[column[learned_pairs] >= depth - 1]
            counted = predicted[chosen]
            log_q = F.log_softmax(self.readout.small(counted).float(), dim=-1)
            count = max(1, int(chosen.sum()))
            kl = (p_rows.exp() * (p_rows - log_q)).sum() / count
            regression = F.smooth_l1_loss(counted.float(), goal[chosen], reduction="none").mean(-1).sum() / count
            loss = loss + (kl + self.settings.regression_weight * regression) / unroll
            suffix = "" if depth == 1 else f"@{depth}"
            metrics["kl" + suffix] = float(kl.detach())
            metrics["top1" + suffix] = float((log_q.argmax(-1) == p_rows.argmax(-1)).float().sum() / count)
            counts[suffix] = float(chosen.sum())
            goal = goal[:, 1:]
        return loss, metrics, counts

    def depth_predictions(self, embeddings: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
                          unroll: int) -> list[torch.Tensor]:
        """The head's predicted features at draft depths 1..unroll, [B, T - d + 1, H] each:
        depth 1 from the pairs (g_t, x_{t+1}) at positions t, depth d + 1 from depth d's
        prediction one position earlier and the next token. Each depth attends to the keys
        of every depth before it (kept in a cache, as drafting keeps them) through
        `drafting_mask`: what the head's cache holds when it drafts that token, not its own
        predictions at earlier positions."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.head.layer_config) if unroll > 1 else None
        lengths: list[int] = []
        out: list[torch.Tensor] = []
        while len(out) < unroll and inputs.shape[1] > 0:
            lengths.append(inputs.shape[1])
            mask = None if len(lengths) == 1 else drafting_mask(lengths, embeddings.device)[..., -lengths[-1]:, :]
            predicted = self.head(embeddings, inputs, positions, cache, attention_mask=mask)
            out.append(predicted)
            inputs, embeddings, positions = predicted[:, :-1], embeddings[:, 1:], positions[:, 1:]
        return out

    def step(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.bf16):
            return self.loss(*self.batch(self.batches.next()))

    @torch.no_grad()
    def evaluate(self, rows: np.ndarray) -> dict[str, float]:
        """KL and top-1 agreement on `rows` (held out), without noise, at the first and the
        second draft step: means over every learned token, whatever batch it fell in."""
        self.head.eval()
        depths = ("", "@2")
        sums = {(name, depth): 0.0 for name in ("kl", "top1") for depth in depths}
        counts = dict.fromkeys(depths, 0.0)
        for first in range(0, len(rows), self.settings.batch_sequences):
            _, metrics, weights = self.weighed_loss(*self.batch(rows[first : first + self.settings.batch_sequences]),
                                                    noise=False, unroll=2)
            for name, depth in sums:
                sums[name, depth] += metrics.get(name + depth, 0.0) * weights.get(depth, 0.0)
            for depth in depths:
                counts[depth] += weights.get(depth, 0.0)
        self.head.train()
        return {name + depth: total / max(1.0, counts[depth]) for (name, depth), total in sums.items()}

    @torch.no_grad()
    def acceptance(self, rows: np.ndarray, depths: int = 4) -> list[float]:
        """Greedy acceptance by draft position on `rows` (held out), without noise: entry
        d - 1 is the share of starts whose first d drafted tokens all equal the target's
        argmax over its whole vocabulary (a token outside the draft vocabulary is a miss),
        drafting from the real features up to the start and the head's own after it, as a
        round does. A start counts at depth d when its d tokens are all ones to learn and the
        text's tokens after it are the target's argmax up to there: only then are the tokens
        fed to the head's later steps the ones it would have drafted (on the target's own
        greedy answers, every start)."""
        self.head.eval()
        hits, counts = np.zeros(depths), np.zeros(depths)
        hidden = self.head.config.hidden_size
        # the target's head over its whole vocabulary: what a drafted token must equal
        whole = Readout(self.target, torch.arange(self.target.get_output_embeddings().weight.shape[0]))
        for first in range(0, len(rows), self.settings.batch_sequences):
            tokens, features, learned = self.batch(rows[first : first + self.settings.batch_sequences])
            length = tokens.shape[1]
            if length < 2:
                continue
            goal = features[:, 1:, -hidden:]
            # row by row: a 152k-token vocabulary's logits for a whole batch would take gigabytes
            wanted = torch.stack([whole.small(g).argmax(-1) for g in goal])  # [B, T - 1]
            learned_pairs = torch.cat([learned[:, 2:], learned[:, -1:]], dim=1)
            # the text's token at pair j + 1 is the one the target says there (what depth d + 1 is fed)
            greedy_text = tokens[:, 2:] == wanted[:, :-1]  # [B, T - 2]
            positions = torch.arange(length - 1, device=tokens.device).expand(tokens.shape[0], -1)
            embeddings = self.embed(tokens[:, 1:]).float()
            chain = valid = None
            for depth, predicted in enumerate(self.depth_predictions(embeddings, self.head.fused(features[:, :-1]),
                                                                     positions, depths), start=1):
                # element s of depth d is start s's d-th drafted token, the target's at pair s + d - 1
                drafted = self.head.vocab_ids.to(tokens.device)[self.readout.small(predicted).argmax(-1)]
                right, counted = drafted == wanted[:, depth - 1 :], learned_pairs[:, depth - 1 :]
                if depth > 1:  # fed the text's token at pair s + d - 1: it must be what was drafted
                    counted = counted & greedy_text[:, depth - 2 :]
                chain = right if chain is None else chain[:, :-1] & right
                valid = counted if valid is None else valid[:, :-1] & counted
                hits[depth - 1] += float((chain & valid).sum())
                counts[depth - 1] += float(valid.sum())
        self.head.train()
        return [float(h / c) if c else 0.0 for h, c in zip(hits, counts)]


def drafting_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Attention over the streams of draft depths 1..d laid end to end ([1, 1, S, S] bool,
    True: attend), as the head attends when it drafts (EAGLE-3's training-time test).
    Stream a's element i is the pair at position p = i + a - 1, fed the real feature at depth
    1 and the head's own prediction from depth a - 1 beyond it. Drafting the a-th token
    after the committed text at p, the head's cache holds the real pairs up to p - a + 1
    and the drafted steps since: so a query (a, p) reads depth 1's keys at positions
    <= p - a + 1 and depth b's key (1 < b <= a) at exactly p - a + b, and nothing else.
    A causal mask over the one stream (depth 1) is the special case a = 1."""
    stream = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(lengths, start=1)])
    position = torch.cat([torch.arange(n) + a - 1 for a, n in enumerate(lengths, start=1)])
    qa, qp = stream[:, None], position[:, None]
    kb, kq = stream[None, :], position[None, :]
    real = (kb == 1) & (kq <= qp - qa + 1)
    drafted = (kb > 1) & (kb <= qa) & (kq == qp - qa + kb)
    return (real | drafted)[None, None].to(device)


def new_head(target: torch.nn.Module, vocab_ids: torch.Tensor, lower_layers: tuple[int, ...] = ()) -> DraftHead:
    """A head for `target` reading out `vocab_ids`, fed the final feature and the hidden
    states after `lower_layers` (none: the final feature only)."""
    # float32 master weights whatever torch's default dtype is (a float64 load may leave it changed)
    head = DraftHead(HeadConfig.for_target(target, int(vocab_ids.numel()), lower_layers)).float()
    head.vocab_ids = vocab_ids.clone()
    head.init_from_target(target)
    return head
