"""A round's token tree: several drafters' chains merged into one tree (a shared prefix is
one branch), verified in one target forward, and accepted losslessly.

Row 0 is the root, the last committed token (the target has not seen it yet); every other
row is a drafted token whose parent row comes before it. The target's forward over the tree
(`CachedLM.feed_tree`) gives each row the logits its own path would get as a chain, so under
greedy decoding the target's argmax at a row is the token plain decoding would commit after
that path: following, from the root, the child whose token is that argmax commits exactly
what plain decoding commits, and the argmax at the last row followed is the bonus token.
Plain Python over the verify's argmax: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class TokenTree:
    tokens: list[int]  # row 0: the root (the last committed token), then drafted tokens
    parents: list[int]  # parents[0] = -1; parents[i] < i
    sources: list[set[int]] = field(default_factory=list)  # per row: the chains through it
    chain_rows: list[list[int]] = field(default_factory=list)  # per chain: its tokens' rows, in order

    @classmethod
    def merge(cls, root: int, chains: Sequence[Sequence[int]]) -> "TokenTree":
        """The tree of `chains` (drafted tokens after `root`), chain j's tokens a path from
        the root; a token a chain shares with another at the same place (same prefix) is
        one row. Rows are in the order chains reach them: a chain's rows come in depth order."""
        tree = cls([root], [-1], [set(range(len(chains)))])
        children: dict[tuple[int, int], int] = {}
        for j, chain in enumerate(chains):
            row = 0
            tree.chain_rows.append([])
            for token in chain:
                child = children.get((row, token))
                if child is None:
                    child = len(tree.tokens)
                    children[(row, token)] = child
                    tree.tokens.append(int(token))
                    tree.parents.append(row)
                    tree.sources.append(set())
                tree.sources[child].add(j)
                tree.chain_rows[j].append(child)
                row = child
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def branches(self) -> int:
        """Leaves: the distinct root-to-leaf paths (1 for a chain; 0 drafted tokens is 1)."""
        parents = set(self.parents[1:])
        return max(1, sum(1 for row in range(1, len(self)) if row not in parents))

    def candidates(self, row: int, depth: int) -> list[tuple[int, int]]:
        """(chain, child row) for every chain through `row` (at `depth`) with a token after
        it, in chain order: the drafts a verifier tries at that node."""
        out = []
        for j, rows in enumerate(self.chain_rows):
            if len(rows) > depth and (depth == 0 or rows[depth - 1] == row):
                out.append((j, rows[depth]))
        return out

    def drafted_paths(self) -> list[list[int]]:
        """Per row, the drafted tokens from the root down to it (none for the root)."""
        paths: list[list[int]] = [[]]
        for row in range(1, len(self)):
            paths.append(paths[self.parents[row]] + [self.tokens[row]])
        return paths

    def path(self, row: int) -> list[int]:
        """The rows from the root down to `row`."""
        rows = [row]
        while rows[-1] > 0:
            rows.append(self.parents[rows[-1]])
        return rows[::-1]


def accept_greedy(tree: TokenTree, argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy acceptance down `tree` given the target's argmax at every row: (the accepted
    path's rows from the root, the committed tokens: the accepted drafted tokens, then the
    target's token after the last of them)."""
    children: dict[tuple[int, int], int] = {}
    for row in range(1, len(tree)):
        children.setdefault((tree.parents[row], tree.tokens[row]), row)
    rows = [0]
    while (rows[-1], int(argmax[rows[-1]])) in children:
        rows.append(children[(rows[-1], int(argmax[rows[-1]]))])
    return rows, [tree.tokens[row] for row in rows[1:]] + [int(argmax[rows[-1]])]


def matched(chain: Sequence[int], committed: Sequence[int]) -> int:
    """How many of `chain`'s leading tokens the round committed: what its drafter keeps."""
    n = 0
    while n < len(chain) and n < len(committed) and chain[n] == committed[n]:
        n += 1
    return n
