"""Lossless acceptance of a draft against the target's verify forward.

Greedy: a drafted token is accepted while it equals the target's argmax; the committed
tokens are then simply the target's argmax at positions 0..n (accepted tokens plus the
recovered or bonus token). Sampling (Leviathan et al. / Chen et al.): accept y_j with
probability min(1, p_j(y_j) / q_j(y_j)); on the first rejection draw from
normalize(max(0, p_j - q_j)); if all are accepted draw the bonus token from p_{k+1}.
A deterministic drafter (n-gram) has one-hot q, passed as `draft_probs=None`.

Everything stays on the device; the caller syncs once to read the packed result.

A token tree (several drafters' chains merged, `core/tree.py`) is accepted by multi-draft
speculative sampling (SpecInfer's recursive rejection): at each node the chains through it
offer their next tokens in turn; draft x from q is accepted with probability
min(1, r(x) / q(x)) where r is what is left of the target's p (p itself at first, then
normalize(max(0, r - q)) after each rejection); the first accepted child is followed, and
when every child is rejected (or there is none) the token is drawn from r. Each chain's
tokens were drawn independently of the others' given the path (or chosen deterministically,
one-hot q), which is what makes the committed token follow p exactly. That walk reads the
host once per draft it tries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.core.sampling import SamplingParams, distributions, greedy_tokens
from specdraft.core.tree import TokenTree
from specdraft.errors import NonFiniteLogits


@dataclass(frozen=True)
class Verdict:
    n_accepted: torch.Tensor  # [] long: how many drafted tokens were accepted
    tokens: torch.Tensor  # [k + 1] long: tokens[:n_accepted + 1] are committed
    alphas: torch.Tensor  # [k] float: 1 - TV(p_j, q_j), the acceptance probability per position


def read_if_finite(values: torch.Tensor, logits: torch.Tensor) -> list:
    """`values` [n] read to the host in the same device read as whether `logits` are all
    finite; NonFiniteLogits when they are not (NaN weights would otherwise decode as token 0
    for ever)."""
    read = torch.cat([values, torch.isfinite(logits).all().view(1).to(values.dtype)]).tolist()
    if not read.pop():
        raise NonFiniteLogits()
    return read


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """1 - TV(p, q) = sum_v min(p(v), q(v)) per row: [n, V] x [n, V] -> [n]."""
    return torch.minimum(p, q.to(p.dtype)).sum(dim=-1)


def alignment(p: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """alpha_j = 1 - TV(p_j, q_j) [k]; for one-hot q (draft_probs None) that is p_j(y_j)."""
    # p: [k, V]; draft_tokens: [k]; draft_probs: [k, V] or None
    if draft_probs is None:
        return p.gather(-1, draft_tokens.view(-1, 1)).squeeze(-1)
    return overlap(p, draft_probs)


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of `flags` [k] -> [] long."""
    return torch.cumprod(flags.long(), dim=0).sum()


def verify_greedy(
    target_logits: torch.Tensor,  # [k + 1, V]
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V] as `distributions` gives them, for alignment only
    params: SamplingParams = SamplingParams(),
) -> Verdict:
    k = draft_tokens.shape[0]
    best = greedy_tokens(target_logits)  # [k + 1]
    matches = draft_tokens == best[:k]  # [k]
    n = _leading_true(matches)
    if params.soft_feedback:
        alphas = alignment(distributions(target_logits[:k], params), draft_tokens, draft_probs)
    else:  # exact: a drafted token is accepted iff it is the target's argmax
        alphas = matches.to(torch.float64 if target_logits.dtype == torch.float64 else torch.float32)
    return Verdict(n, best, alphas)


def verify_sampling(
    target_probs: torch.Tensor,  # [k + 1, V], already temperature / top-k / top-p processed
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V] with the same processing, None for one-hot
    generator: torch.Generator | None,
) -> Verdict:
    k = draft_tokens.shape[0]
    p = target_probs
    index = draft_tokens.view(-1, 1)
    p_y = p[:k].gather(-1, index).squeeze(-1)  # [k]
    if draft_probs is None:
        q = torch.zeros_like(p[:k]).scatter_(-1, index, 1.0)
    else:
        q = draft_probs.to(p.dtype)
    q_y = q.gather(-1, index).squeeze(-1)
    # u < p/q  <=>  u*q < p, which also covers q_y = 0 without dividing by it.
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    n = _leading_true(u * q_y < p_y)

    # Row j < k: the residual after rejecting at j; row k: the target itself (bonus token).
    residual = torch.cat([torch.clamp(p[:k] - q, min=0.0), p[k:]], dim=0)  # [k + 1, V]
    row = residual.index_select(0, n.view(1))  # [1, V]
    mass = row.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual; rejection then had probability 0, but guard rounding.
    row = torch.where(mass > 0, row / mass.clamp_min(torch.finfo(p.dtype).tiny), p.index_select(0, n.view(1)))
    fix = torch.multinomial(row, 1, generator=generator).view(1)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
    tokens = tokens.scatter(0, n.view(1), fix)
    return Verdict(n, tokens, alignment(p[:k], draft_tokens, draft_probs))


def verify_tree_sampling(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [rows, V] p at every row of the tree, processed
    chain_probs: list[torch.Tensor | None],  # per chain: [its tokens, V] q, or None for one-hot
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Multi-draft speculative sampling down `tree` (module docstring): (the accepted path's
    rows from the root, the committed tokens: the accepted drafts, then the recovered or
    bonus token)."""
    rows: list[int] = [0]
    tokens: list[int] = []
    while True:
        node, depth = rows[-1], len(rows) - 1
        residual = target_probs[node]
        chosen = None
        for j, child in tree.candidates(node, depth):
            token = tree.tokens[child]
            q = chain_probs[j]
            if q is None:
                q_row = torch.zeros_like(residual).index_fill_(0, torch.tensor([token], device=residual.device), 1.0)
            else:
                q_row = q[depth].to(residual.dtype)
            u = torch.rand((), generator=generator, device=residual.device, dtype=residual.dtype)
            if bool(u * q_row[token] < residual[token]):
                chosen = child
                break
            left = torch.clamp(residual - q_row, min=0.0)
            mass = left.sum()
            if bool(mass > 0):  # (no mass left only by rounding: rejection had probability 0)
                residual = left / mass
        if chosen is None:
            tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            return rows, tokens
        rows.append(chosen)
        tokens.append(tree.tokens[chosen])


def tree_alignment(tree: TokenTree, target: torch.Tensor, greedy: bool, chain: int,
                   draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """A chain's alpha_j as it would get alone [k]: every row of the tree carries its own
    path's target distribution, so position j is judged at the row of the chain's token
    before it (the root for j = 0). `target`: the argmax per row [rows] when `greedy`, else
    the processed p [rows, V]."""
    rows = tree.chain_rows[chain]
    parents = torch.tensor([0, *rows[:-1]], dtype=torch.long, device=draft_tokens.device)
    if greedy:
        return (target.index_select(0, parents) == draft_tokens).to(torch.float32)
    return alignment(target.index_select(0, parents), draft_tokens, draft_probs)
