"""A round's proposals and what its verify hands on (`Verified`), and the verify of a token
tree: several drafters' chains merged (`core/tree.py`), one target forward over the tree,
lossless acceptance down it (greedy: the target's argmax; sampling: multi-draft speculative
sampling, `core/verify.py`), the target's cache cut to the accepted path, and per chain what
was committed of it and its alignment as it would be alone (every row carries its own
path's distribution)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdraft.core.penalty import RepeatPenalty
from specdraft.core.sampling import SamplingParams, distributions, greedy_tokens, sampling_probs
from specdraft.core.tree import TokenTree, accept_greedy, matched
from specdraft.core.verify import read_if_finite, tree_alignment, verify_tree_sampling
from specdraft.drafters.base import Draft
from specdraft.models.cached_lm import CachedLM


@dataclass
class Proposal:
    """One drafter's chain in a round."""

    arm: int
    draft: Draft
    seconds: float  # its propose call, catch-up excluded
    # Its draft's `width` runner-ups (`Draft.runner_ups`) at each of its first `runner_ups`
    # positions are verified too, each a leaf beside the chain's token there.
    runner_ups: int = 0
    width: int = 1

    @property
    def drafted(self) -> int:
        return self.draft.tokens.shape[0]


@dataclass(kw_only=True)
class Verified:
    """The verify step's result, read from the device once (a tree's walk under sampling
    reads once per draft it tries)."""

    accepted: int
    tokens: list[int]  # accepted drafts + the recovered or bonus token
    alphas: list[float]  # the chosen drafter's, per drafted position
    next_input: torch.Tensor  # [1] the last committed token: the next verify feeds it
    width: int  # tokens the forward ran over: k + 1, or more when a wider forward is cheaper
    # Per drafter that proposed: the alignment of its first positions that lie on the
    # committed path [n], which the evaluator reuses as its score there.
    known_alphas: dict[int, torch.Tensor]
    logits: torch.Tensor  # [accepted + 1 or more, V] at the committed positions
    probs: torch.Tensor | None  # the same rows' processed p under sampling, None under greedy
    hidden: dict[int, torch.Tensor]  # {layer: [accepted + 1 or more, H]} for the drafters scored from them
    kept: list[tuple[int, int]]  # per proposal: (arm, its drafted tokens committed), the chosen one first
    tree_size: int  # drafted tokens verified (a tree's rows less the root)
    # Per proposal whose draft ranks tokens and was wrong inside it: (arm, where the token
    # committed at its first wrong position came in its order after its drafted one: 1 =
    # its runner-up), whether its leaves were verified or not.
    runner_up_ranks: list[tuple[int, int]] = field(default_factory=list)
    runner_up_leaves: list[tuple[int, int]] = field(default_factory=list)  # (arm, its leaves) in the tree
    runner_up_won: int | None = None  # the arm whose runner-up leaf the committed path ended on


def runner_up_ranks(proposals: Sequence[Proposal], chains: Sequence[Sequence[int]], committed: Sequence[int]
                    ) -> list[tuple[int, int]]:
    """(arm, rank) per proposal whose draft ranks tokens and was wrong inside it: where
    the token committed at its first wrong position comes in its order after the drafted
    one (1: its runner-up). Under greedy, leaves of width w there are (or would have been)
    accepted exactly when rank <= w; under sampling, with the chain the node's only draft,
    the committed token is drawn from the residual, so rank <= w as often as such leaves
    would be accepted."""
    ranks = []
    for p, chain in zip(proposals, chains):
        if p.draft.ranking:
            n = matched(chain, committed)
            if n < len(chain) and n < len(committed):
                ranks.append((p.arm, p.draft.rank_at(n, committed[n])))
    return ranks


def verify_tree(target: CachedLM, context: Sequence[int], proposals: list[Proposal],
                padded_width: Callable[[int], int], layers: Sequence[int], params: SamplingParams,
                generator: torch.Generator | None, penalty: RepeatPenalty = RepeatPenalty()) -> Verified:
    """One target forward over the token tree of every proposal's chain (shared prefixes
    merged, each row attending its own path) and lossless acceptance down it: greedy
    follows the target's argmax, sampling tries each node's drafts in turn (multi-draft
    speculative sampling, core/verify.py). The target's cache keeps only the accepted
    path. Padded with filler rows below the last one when a wider forward is cheaper.
    `context`: the committed tokens, the root (the last of them) included."""
    device = target.device
    chains, ranked = _read_drafts(proposals)
    # Runner-up leaves after every chain, so chain j is still row set j: a chain's prefix
    # then the runner-up, one-hot q (a deterministic draft; see `ranked_next`).
    leaves = [(j, chains[j][: i // p.width] + [token]) for j, p in enumerate(proposals)
              for i, token in enumerate(ranked[j])]
    tree = TokenTree.merge(context[-1], chains + [leaf for _, leaf in leaves])
    rows = len(tree)
    width = padded_width(rows)
    ids = torch.tensor(tree.tokens + [tree.tokens[-1]] * (width - rows), dtype=torch.long, device=device)
    logits, hidden = target.feed_tree(ids, tree.parents + list(range(rows - 1, width - 1)), layers)
    logits = penalty.rows(logits[:rows], context, tree.drafted_paths()) if penalty.active else logits[:rows]
    path, tokens, judge, probs = _accept(tree, logits, params, [p.draft.probs for p in proposals] + [None] * len(leaves),
                                         generator)
    target.keep_path(path)
    kept = [(p.arm, matched(chain, tokens)) for p, chain in zip(proposals, chains)]
    exact = params.one_hot
    aligned = {p.arm: tree_alignment(tree, judge, exact, j, p.draft.tokens, p.draft.probs)
               for j, p in enumerate(proposals) if p.drafted}
    known = {arm: aligned[arm][: n + 1] for arm, n in kept if arm in aligned}
    chosen = aligned.get(proposals[0].arm)
    alphas = [] if chosen is None else chosen.double().tolist()
    index = torch.tensor(path, dtype=torch.long, device=logits.device)
    # The path ends on a runner-up's leaf when only leaves pass through its last row.
    through = sorted(tree.sources[path[-1]]) if len(path) > 1 else []
    won = proposals[leaves[through[0] - len(proposals)][0]].arm if through and through[0] >= len(proposals) else None
    return Verified(accepted=len(path) - 1, tokens=tokens, alphas=alphas,
                    next_input=torch.tensor(tokens[-1:], dtype=torch.long, device=device), width=width,
                    known_alphas=known, logits=logits.index_select(0, index),
                    probs=None if probs is None else probs.index_select(0, index),
                    hidden={layer: h[:rows].index_select(0, index.to(h.device)) for layer, h in hidden.items()},
                    kept=kept, tree_size=rows - 1, runner_up_ranks=runner_up_ranks(proposals, chains, tokens),
                    runner_up_leaves=[(proposals[j].arm, n) for j, n in sorted(Counter(j for j, _ in leaves).items())],
                    runner_up_won=won)


def _accept(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, chain_probs: list[torch.Tensor | None],
            generator: torch.Generator | None) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor | None]:
    """Lossless acceptance down `tree`: (the accepted path's rows, the committed tokens, what
    the chains are judged against (the argmax per row, or p), p under sampling else None)."""
    if params.greedy:
        best = greedy_tokens(logits)
        path, tokens = accept_greedy(tree, read_if_finite(best, logits))
        return path, tokens, distributions(logits, params) if params.soft_feedback else best, None
    read_if_finite(logits.new_empty(0), logits)  # the sampling verify reads its own values
    probs = sampling_probs(logits, params)
    path, tokens = verify_tree_sampling(tree, probs, chain_probs, generator)
    return path, tokens, probs, probs


def _read_drafts(proposals: Sequence[Proposal]) -> tuple[list[list[int]], list[list[int]]]:
    """Every proposal's drafted tokens and the runner-ups of the leaves it is given (none
    where its draft ranks nothing), in one device-to-host read."""
    leaves = [p.draft.leaf_tokens(p.runner_ups, p.width) for p in proposals]
    flat = torch.cat([p.draft.tokens for p in proposals] + leaves).tolist()
    chains, ranked, offset = [], [], 0
    for p in proposals:
        chains.append(flat[offset : offset + p.drafted])
        offset += p.drafted
    for ranks in leaves:
        n = ranks.shape[0]
        ranked.append(flat[offset : offset + n])
        offset += n
    return chains, ranked

