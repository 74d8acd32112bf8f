"""Turning logits into the distributions that drafting and verification compare.

The same transform (temperature, then top-k, then top-p) is applied to the target's p and
to every drafter's q: speculative sampling is only lossless if both sides see the same
processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Under greedy decoding, alignment feedback compares temperature-1 softmaxes instead of
    # the one-hot argmaxes that decide acceptance. Only for reproducing older numbers: it
    # rewards a drafter whose distribution looks like the target's while its argmax disagrees.
    soft_feedback: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def one_hot(self) -> bool:
        """p and q are the one-hot argmaxes (greedy decoding, exact feedback): a drafted
        token's alignment is whether it is the target's token, no distribution needed."""
        return self.greedy and not self.soft_feedback


def _wide(logits: torch.Tensor) -> torch.Tensor:
    # Half-precision softmax over 50k+ entries loses the tail; do it in float32 at least.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def plain_probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax at temperature 1 [n, V]."""
    return torch.softmax(_wide(logits), dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension [..., V] -> [...] (int64), the first maximum on
    ties (NaN counts as the maximum), as torch.argmax gives it. A float CPU tensor goes
    through numpy's argmax, whose vectorised scan of a vocabulary row is several times
    faster than torch's CPU argmax: once per verified row, it was a visible share of a
    small target's step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) \
            and not logits.requires_grad and logits.dim() >= 1 and logits.shape[-1] > 0:
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1), dtype=np.int64))
    return logits.argmax(dim=-1)


def ranked_next(scores: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """The highest-scoring token of `scores` [1, V] not in `excluded` [n] (argmax's order:
    the first of equal scores): after the drafted token, a draft position's runner-up, and
    after it too the next. A function of the drafted token and the drafter's own scores
    only, so under sampling it is one more deterministic draft at that node, which keeps
    multi-draft speculative sampling exact (`core/verify.py` `verify_tree_sampling`)."""
    return greedy_tokens(scores.index_fill(-1, excluded.view(-1).to(scores.device), float("-inf")))


def rank_after(scores: torch.Tensor, drafted: int, token: int) -> int:
    """Where `token` comes in `ranked_next`'s order of `scores` [1, V] after the `drafted`
    token: 1 for the runner-up, 2 for the next, ... (`token` != `drafted`)."""
    row = scores.view(-1)
    score = row[token]
    ahead = int((row > score).sum()) + int((row[:token] == score).sum())  # argmax takes the first of equals
    drafted_ahead = bool(row[drafted] > score) or (drafted < token and bool(row[drafted] == score))
    return ahead - drafted_ahead + 1


def argmax_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """One-hot at the argmax [n, V]: greedy decoding's p (and a greedy drafter's q)."""
    wide = _wide(logits)
    return torch.zeros_like(wide).scatter_(-1, greedy_tokens(wide).unsqueeze(-1), 1.0)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from [n, V]: temperature, top-k, top-p, renormalised."""
    scores = _wide(logits) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens ranked before it already reach top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range must not drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def distributions(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding draws from [n, V], for the target's p and every drafter's q
    alike: processed for sampling; under greedy the one-hot argmax, so alignment
    1 - TV(p, q) is exactly 1[argmax q == argmax p], the real acceptance."""
    if not params.greedy:
        return sampling_probs(logits, params)
    return plain_probs(logits) if params.soft_feedback else argmax_one_hot(logits)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `probs` [n, V] -> [n], with no host synchronisation."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
