"""Token trees: several chains merged, one forward over the tree giving every row the logits
of its own path fed as a chain (bit for bit on the lean file-quantized and bfloat16 targets,
up to float64 rounding through transformers with a dynamic or a static cache), the accepted
path's keys and values moved into place, and greedy acceptance down the tree committing
what plain decoding commits."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.core.tree import TokenTree, accept_greedy
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels.native import kernel_problem

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


def test_chains_merge_on_shared_prefixes():
    tree = TokenTree.merge(7, [[1, 2, 3], [1, 2, 4], [5], [1, 9], []])
    assert tree.tokens == [7, 1, 2, 3, 4, 5, 9]
    assert tree.parents == [-1, 0, 1, 2, 2, 0, 1]
    assert tree.sources[1] == {0, 1, 3} and tree.sources[4] == {1} and tree.sources[5] == {2}
    assert tree.branches == 4 and tree.path(4) == [0, 1, 2, 4]
    assert TokenTree.merge(7, [[1, 2]]).branches == 1 and TokenTree.merge(7, []).branches == 1


def test_greedy_acceptance_follows_the_targets_argmax_down_the_tree():
    tree = TokenTree.merge(7, [[1, 2, 3], [1, 2, 4], [5]])  # rows 0:7 1:1 2:2 3:3 4:4 5:5
    assert accept_greedy(tree, [1, 2, 4, 0, 8, 0]) == ([0, 1, 2, 4], [1, 2, 4, 8])
    assert accept_greedy(tree, [5, 0, 0, 0, 0, 6]) == ([0, 5], [5, 6])
    assert accept_greedy(tree, [9, 0, 0, 0, 0, 0]) == ([0], [9])


def targets():
    from test_file_quantization import quantized_tiny
    from test_float_blocks import bf16_tiny

    from tiny import tiny_llama

    return {"gguf codes": (quantized_tiny(seed=2), {"lean": True}),
            "bfloat16": (bf16_tiny(seed=2), {"lean": True}),
            "transformers, dynamic cache": (tiny_llama(seed=2, vocab=96), {}),
            "transformers, static cache": (tiny_llama(seed=2, vocab=96), {"static": True})}


class Target:
    """A model and how its CachedLM is made; lean ones match chains bit for bit, the float64
    ones through transformers up to rounding."""

    def __init__(self, name: str):
        self.model, self.options = targets()[name]
        self.exact = self.options.get("lean", False)

    def lm(self) -> CachedLM:
        return CachedLM(self.model, **self.options)

    def same(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if self.exact else torch.allclose(a, b, rtol=0, atol=1e-9)


@pytest.fixture(scope="module", params=["gguf codes", "bfloat16", "transformers, dynamic cache",
                                        "transformers, static cache"])
def target(request):
    return Target(request.param)


def random_tree(rng: random.Random, vocab: int, chains: int, depth: int) -> TokenTree:
    """Chains that share prefixes often (few distinct tokens), so trees branch at every depth."""
    return TokenTree.merge(rng.randrange(3, vocab), [[rng.randrange(3, 6) for _ in range(rng.randint(0, depth))]
                                                     for _ in range(chains)])


@pytest.mark.parametrize("whole_layers_in_c", [True, False])
def test_every_tree_row_gets_its_paths_chain_logits(target, whole_layers_in_c):
    if not target.exact and not whole_layers_in_c:
        pytest.skip("a lean forward's option")
    vocab = target.model.config.vocab_size
    rng = random.Random(0)
    prompt = torch.tensor([rng.randrange(3, vocab) for _ in range(30)])
    for trial in range(6):
        tree = random_tree(rng, vocab, chains=rng.randint(1, 5), depth=6)
        lm = target.lm()
        if lm.lean is not None:
            lm.lean.whole_layers_in_c = whole_layers_in_c
        lm.feed(prompt)
        logits, hidden = lm.feed_tree(torch.tensor(tree.tokens), tree.parents, layers=(1,))
        assert logits.shape == (len(tree), vocab) and hidden[1].shape[0] == len(tree)
        for row in range(len(tree)):
            chain = target.lm()
            chain.feed(prompt)
            path = torch.tensor([tree.tokens[r] for r in tree.path(row)])
            expected, chain_hidden = chain.feed_with_hidden(path, 1, (1,))
            assert target.same(logits[row], expected[0]), (trial, row, tree.parents)
            assert target.same(hidden[1][row], chain_hidden[1][-1])


def test_keeping_a_path_leaves_the_cache_as_if_the_path_alone_was_fed(target):
    vocab = target.model.config.vocab_size
    rng = random.Random(1)
    prompt = torch.tensor([rng.randrange(3, vocab) for _ in range(25)])
    for trial in range(5):
        tree = random_tree(rng, vocab, chains=4, depth=5)
        leaf = max(range(len(tree)), key=lambda r: (len(tree.path(r)), r))  # a deepest row, often not the last
        rows = tree.path(rng.choice([leaf, rng.randrange(len(tree))]))
        lm = target.lm()
        lm.feed(prompt)
        lm.feed_tree(torch.tensor(tree.tokens), tree.parents)
        lm.keep_path(rows)
        assert lm.length == len(prompt) + len(rows)
        after = torch.tensor([rng.randrange(3, vocab) for _ in range(4)])
        got = lm.feed(after, keep=0)
        chain = target.lm()
        chain.feed(torch.cat([prompt, torch.tensor([tree.tokens[r] for r in rows])]))
        assert target.same(got, chain.feed(after, keep=0)), (trial, rows)


def test_greedy_tree_rounds_commit_plain_decodings_text(target):
    """Rounds of merged chains (some right, some wrong, some the same) verified as trees:
    the committed text is plain greedy decoding's, token for token."""
    vocab = target.model.config.vocab_size
    rng = random.Random(2)
    prompt = [rng.randrange(3, vocab) for _ in range(12)]
    steps = target.lm()  # plain decoding of the target as run: one token a step
    logits, reference = steps.feed(torch.tensor(prompt)), []
    while len(reference) < 60:
        reference.append(int(logits[-1].argmax()))
        logits = steps.feed(torch.tensor(reference[-1:]))
    lm = target.lm()
    lm.feed(torch.tensor(prompt[:-1]))
    committed, last, branched = [], prompt[-1], 0
    while len(committed) < 60:
        truth = reference[len(committed):len(committed) + 6]
        chains = [truth[:rng.randint(0, len(truth))],  # a chain right for a while, then wrong
                  truth[:rng.randint(0, 2)] + [rng.randrange(3, vocab) for _ in range(3)],
                  [rng.randrange(3, vocab) for _ in range(2)]]
        tree = TokenTree.merge(last, chains)
        branched += tree.branches > 1
        logits, _ = lm.feed_tree(torch.tensor(tree.tokens), tree.parents)
        rows, tokens = accept_greedy(tree, logits.argmax(-1).tolist())
        lm.keep_path(rows)
        committed += tokens
        last = tokens[-1]
    assert committed[:60] == reference
    assert branched > 5
