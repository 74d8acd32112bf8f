"""Runner-up leaves (EAGLE-2's top-k at a position): a model or head drafter's next-ranked
token at each drafted position, verified as a leaf beside its chain. Greedy output stays
plain greedy decoding's, sampled output follows the target's law (a runner-up is a
deterministic draft given the drafter's own choice), the planner learns from every round
how often a drafter's runner-up is right where its draft is first wrong, and adds leaves
only where they are estimated to pay."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from specdraft.core.sampling import SamplingParams, rank_after, ranked_next
from specdraft.core.tree import TokenTree
from specdraft.core.verify import verify_tree_sampling
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.decoding.tree_verify import Proposal, runner_up_ranks
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter
from specdraft.drafters.base import Draft, Drafter
from specdraft.learning.policies import build_policy
from specdraft.learning.policies.simple import FixedPolicy, RandomPolicy
from specdraft.models.cached_lm import CachedLM
from specdraft.session.stats import GenerationStats
from specdraft.ui.panel import stats_panel
from specdraft.ui.tables import _trees
from test_sampling import P_MIN, SAMPLING_PROMPT, assert_follows_laws, chi_square_p, pair_and_third_laws, sampling_pool
from test_tree_round import PROMPTS, greedy_pool, planner_with, scripted_branches
from tiny import VOCAB, plain_greedy, tiny_llama


def scripted_leaves(engine: SpeculativeEngine, seed: int) -> None:
    """On top of the engine's plans, every chain gets 1..3 runner-up leaves at each of a
    random number (0..3) of its first positions."""
    rng = random.Random(seed)
    choose = engine.driver.choose

    def with_leaves(produced, awake=None):
        plan = choose(produced, awake)
        arms = [plan.arm, *(arm for arm, _ in plan.branches)]
        return replace(plan, runner_ups=tuple((arm, rng.randint(0, 3), rng.randint(1, 3)) for arm in arms))

    engine.driver.choose = with_leaves


def test_the_runner_up_is_the_next_ranked_token_other_than_the_drafted_one():
    scores = torch.tensor([[0.1, 0.7, 0.05, 0.15]])
    assert ranked_next(scores, torch.tensor([1])).tolist() == [3]
    assert ranked_next(scores, torch.tensor([3])).tolist() == [1]  # a sampled token that was not the mode
    assert ranked_next(scores, torch.tensor([1, 3])).tolist() == [0]


def test_a_tokens_rank_is_where_the_runner_ups_order_puts_it():
    """`rank_after` agrees with repeated `ranked_next` (argmax's order, ties by lower id),
    which decides the leaves: a verdict of rank r means leaves of width >= r hold the token."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        scores = torch.randint(0, 4, (1, 12), generator=gen).double()  # many ties
        drafted = int(torch.randint(0, 12, (1,), generator=gen))
        order, excluded = [], torch.tensor([drafted])
        for _ in range(11):
            order.append(int(ranked_next(scores, excluded)))
            excluded = torch.cat([excluded, torch.tensor(order[-1:])])
        assert [rank_after(scores, drafted, token) for token in order] == list(range(1, 12))


def test_a_model_drafter_ranks_runner_ups_only_when_asked():
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    small = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))
    assert small.propose(PROMPTS[0], 4).ranking is None
    small.reset()
    draft = small.propose(PROMPTS[0], 4, runner_up=True)
    ranked = draft.leaf_tokens(4, 1)
    assert ranked.shape == draft.tokens.shape and bool((ranked != draft.tokens).all())
    assert draft.leaf_tokens(2, 1).tolist() == ranked[:2].tolist()
    assert draft.leaf_tokens(2, 3).view(2, 3)[:, 0].tolist() == ranked[:2].tolist()
    # the first position's runner-ups are the small model's second, third and fourth choices
    logits = tiny_llama(seed=1, layers=1)(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert draft.runner_ups(0, 3).tolist() == torch.topk(logits, 4).indices[1:].tolist()
    assert draft.rank_at(0, int(torch.topk(logits, 4).indices[3])) == 3
    assert NgramDrafter("lookup", ctx, 1, 3).propose(PROMPTS[0], 4, runner_up=True).ranking is None
    del target


def ranked_draft(tokens, ranked):
    """A draft of `tokens` whose drafter ranked the tokens `ranked[j]` next at position j,
    in that order, the rest after them (None: no ranking)."""
    rows = None
    if ranked is not None:
        rows = []
        for token, after in zip(tokens, ranked):
            row = torch.zeros(1, VOCAB)
            for place, t in enumerate([token, *after]):
                row[0, t] = len(after) + 1 - place
            rows.append(row)
    return Draft(torch.tensor(tokens), None, ranking=tuple(rows) if rows else None)


def test_a_runner_up_verdict_is_taken_at_the_first_wrong_position():
    chains = [[1, 2, 3], [1, 2, 3], [7, 8], [5]]
    ranked = [[[9], [8], [4]], [[9], [6], [5, 4]], None, [[6, 7]]]
    proposals = [Proposal(arm, ranked_draft(chain, r), 0.0) for arm, (chain, r) in enumerate(zip(chains, ranked))]
    ranks = runner_up_ranks(proposals, chains, [1, 2, 4, 0])
    # wrong at position 2: the committed 4 is arm 0's runner-up there, arm 1's second; arm 2
    # ranks nothing; arm 3 is wrong at position 0, where it ranks 6, 7, then every other
    # token by id (0 first, then 1: rank 4)
    assert ranks == [(0, 1), (1, 2), (3, 4)]
    assert runner_up_ranks(proposals[:1], chains[:1], [1, 2, 3, 9]) == []  # never wrong
    assert proposals[0].draft.leaf_tokens(5, 1).tolist() == [9, 8, 4]
    assert proposals[1].draft.leaf_tokens(3, 2).tolist() == [9, 0, 6, 0, 5, 4]
    assert proposals[2].draft.leaf_tokens(2, 1).numel() == 0


def test_a_sampled_draft_and_its_runner_up_at_one_node_commit_tokens_distributed_as_p():
    """The runner-up depends on the token drawn (the most likely other one), yet offered
    after it as a one-hot draft against the residual, the committed token follows p."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, -1)
    counts, leaf_won, n_draws = Counter(), 0, 8000
    for _ in range(n_draws):
        x = torch.multinomial(q, 1, generator=gen)
        leaf = int(ranked_next(q.view(1, -1), x))
        tree = TokenTree.merge(0, [[int(x)], [leaf]])
        _, tokens = verify_tree_sampling(tree, p.expand(len(tree), vocab).clone(), [q.view(1, -1), None], gen)
        counts[tokens[0]] += 1
        leaf_won += tokens[0] == leaf != int(x)
    assert chi_square_p(counts, {v: float(p[v]) for v in range(vocab)}, n_draws) > P_MIN
    assert leaf_won > n_draws / 20


@pytest.mark.parametrize("static", [False, True])
def test_runner_up_leaves_commit_what_plain_greedy_decoding_commits(static):
    """Leaves on the chosen chain and on branches, every drafter kind that ranks (a small
    model, the target's own layers over its cache, the target itself, a head)."""
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target, static=static)
    drafters = greedy_pool(target, target_lm, ctx)
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=2),
                               EngineSettings(5, 40, SamplingParams()))
    scripted_branches(engine, seed=3, most=2, least=0)
    scripted_leaves(engine, seed=4)
    leaves, won = Counter(), Counter()
    for prompt in PROMPTS + [[7, 7, 8, 30, 31, 7, 8], [50, 2, 9, 50, 2, 9, 50]] + [p[::-1] for p in PROMPTS]:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 40)
        assert target_lm.length == len(prompt) + 40 - 1
        for r in records:
            for name, n in r.tree.runner_ups:
                leaves[name] += n
            assert r.tree.tree_size <= sum(d for _, d, _ in r.tree.branches) + sum(n for _, n in r.tree.runner_ups)
            if r.tree.runner_up_won is not None:
                won[r.tree.runner_up_won] += 1
                assert r.tree.winner == r.tree.runner_up_won and r.tree.runner_up_won in dict(r.tree.runner_ups)
    assert {"small", "half", "shared", "head"} <= set(leaves) and "lookup" not in leaves
    assert all(r.tree.winner is not None for r in records if r.tree.runner_up_won)


class WrongThenRanked(Drafter):
    """Drafts plain greedy decoding's next k tokens with the one at a random position
    replaced by another, and ranks the right token there `rank`-th after it: wherever that
    position has `rank` or more leaves, one of them must be the committed token."""

    def __init__(self, ctx, target, seed, rank=1):
        super().__init__("wrong-then-ranked", ctx)
        self.target, self.rng, self.wrong_at, self.rank = target, random.Random(seed), None, rank

    def propose(self, context, k, stop=None, runner_up=False):
        right = plain_greedy(self.target, list(context), k)
        self.wrong_at = self.rng.randrange(k)
        tokens = list(right)
        tokens[self.wrong_at] = (right[self.wrong_at] + 1) % VOCAB
        decoys = [[(t + 2 + i) % VOCAB for i in range(self.rank - 1)] for t in right]
        ranked = [d + [(t + 9) % VOCAB] for t, d in zip(right, decoys)]
        ranked[self.wrong_at] = decoys[self.wrong_at] + [right[self.wrong_at]]
        return ranked_draft(tokens, ranked if runner_up else None)

    def score(self, context, start, count, target_probs, hidden=None):
        return target_probs.new_zeros(count)

    def trajectory_scores(self, context, prompt_len, target_probs, k):
        raise NotImplementedError


@pytest.mark.parametrize("rank, width", [(1, 1), (2, 1), (2, 2), (2, 3)])
def test_a_leaf_that_holds_the_targets_token_is_committed_with_the_bonus_after_it(rank, width):
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    ranked = WrongThenRanked(ctx, target, seed=1, rank=rank)
    engine = SpeculativeEngine(CachedLM(target), [ranked], FixedPolicy(["wrong-then-ranked"], {"draft_length": "fixed"}),
                               EngineSettings(5, 40, SamplingParams()))
    choose = engine.driver.choose
    engine.driver.choose = lambda produced, awake=None: replace(choose(produced, awake), runner_ups=((0, 3, width),))
    held = rank <= width
    context, won = list(PROMPTS[0]), 0
    stats = GenerationStats(["wrong-then-ranked"])
    records = []
    for record in engine.generate(PROMPTS[0]):  # (live: the drafter's last draft is this round's)
        records.append(record)
        stats.add(record)
        if record.finish is None and record.drafted:
            wrong, leaves = ranked.wrong_at, min(3, record.drafted) * width
            # the chain is right up to its wrong token; a leaf there holds the target's token
            # when the drafter ranks it within the leaves' width
            hit = wrong < 3 and held
            assert record.accepted == (wrong + 1 if hit else wrong)
            assert (record.tree.runner_up_won == "wrong-then-ranked") == hit
            assert record.tree.runner_ups == [("wrong-then-ranked", leaves)] and record.tree.tree_size == record.drafted + leaves
            won += hit
        context.extend(record.tokens)
    assert context[len(PROMPTS[0]):] == plain_greedy(target, PROMPTS[0], 40) and (won >= 3) == held
    # what the panel and bench show of it
    console = Console(width=200, record=True)
    console.print(stats_panel(stats, "fixed"))
    text = console.export_text()
    share = stats.runner_up_rounds / stats.rounds
    assert stats.runner_up_wins == sum(r.tree.runner_up_won is not None for r in records)
    assert f"runner-up leaves in {share:.0%} of rounds" in text
    assert _trees({"runner_up_share": 0.5, "runner_up_wins": 0.25}) == "leaves 50% · won 25%"


def test_sampled_runner_up_leaves_follow_the_target():
    """Three tokens sampled with runner-up leaves (and branches) every round follow the
    target's joint law."""
    params = SamplingParams(1.0)
    target, target_lm, gen, drafters = sampling_pool(params)
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=2),
                               EngineSettings(3, 3, params), gen)
    scripted_branches(engine, seed=4, most=1, deepest=3, least=0)
    scripted_leaves(engine, seed=5)
    joint2, marginal3 = pair_and_third_laws(target, SAMPLING_PROMPT, params)
    seen = Counter()

    def count_leaves(records):
        seen["leaves"] += sum(n for r in records for _, n in r.tree.runner_ups)
        seen["won"] += sum(r.tree.runner_up_won is not None for r in records)

    assert_follows_laws(engine, SAMPLING_PROMPT, joint2, marginal3, count_leaves)
    assert seen["leaves"] >= 500 and seen["won"] >= 5


# --- the planner ----------------------------------------------------------------------------

def test_leaves_are_planned_where_the_runner_up_is_often_right_where_the_draft_is_not():
    planner = planner_with([1.0] * 4 + [1.5] * 12, [0.01, 0.01, 0.01, 0.0])
    for t in range(40):  # a is wrong at its first token half the time, else right 4 times; b and c agree
        runs = [0.0 if t % 2 else 4.0] * 3
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
    assert planner.branches(0, 4, 8, None) is None  # no runner-up verdicts yet
    for t in range(16):
        planner.observe_runner_ups([(0, 1 if t % 4 else 9)])  # the runner-up right 3 times in 4
    planner.reset()
    branches, leaves, expected, seconds = planner.branches(0, 4, 8, None)
    assert branches == () and leaves == ((0, 1, 1),)  # one leaf, at the position a is wrong at
    assert expected == pytest.approx(1 + 2 + 0.5 * 0.75)  # a's runs, then the leaf's hits


def test_leaves_are_as_wide_as_the_ranks_the_target_takes():
    """The target's token is a's third choice (rank 2) as often as its second: two leaves
    at the position a is wrong at double what one adds, three add nothing more."""
    planner = planner_with([1.0] * 16, [0.01, 0.01, 0.01, 0.0])
    for t in range(40):
        runs = [0.0 if t % 2 else 4.0] * 3
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
        planner.observe_runner_ups([(0, [1, 2, 7, 7][t % 4])])
    assert planner.runner_up_rate(0, 1) == pytest.approx(0.25) and planner.runner_up_rate(0, 3) == pytest.approx(0.5)
    branches, leaves, expected, _ = planner.branches(0, 4, 8, None)
    assert leaves == ((0, 1, 2),) and expected == pytest.approx(1 + 2 + 0.5 * 0.5)


def test_no_leaf_where_the_runner_up_is_rarely_right_or_a_row_costs_too_much():
    for hit_every, costs in ((8, [1.0] * 16), (2, [1.0, 1.0, 1.0, 1.0, 1.0, 2.0] + [2.0] * 10)):
        planner = planner_with(costs, [0.01, 0.01, 0.01, 0.0])
        for t in range(40):
            runs = [0.0 if t % 2 else 4.0] * 3
            planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
            planner.observe_runner_ups([(0, 1 if t % hit_every == 0 else 5)])
        assert planner.branches(0, 4, 8, None) is None


@pytest.mark.parametrize("static", [False, True])
def test_the_planners_own_leaves_keep_greedy_output_identical_and_are_reported(static):
    """Leaves as the planner plans them (made eager), learned from the rounds' verdicts."""
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target, static=static)
    drafters = greedy_pool(target, target_lm, ctx)
    policy = build_policy("normalhedge", {"evaluate": "all"}, [d.name for d in drafters], seed=0, draft_tokens=5,
                          horizon=60)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(5, 60, SamplingParams()))
    tree = engine.driver.planner.tree
    tree.GAIN, tree.MIN_ROUNDS = 0.0, 1  # every leaf that has a rate at all
    stats = GenerationStats([d.name for d in drafters])
    for prompt in PROMPTS * 3:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 60)
        for r in records:
            stats.add(r)
    names = [d.name for d in drafters]
    ranking = {name for name, seen in zip(names, tree.runner_up_seen) if seen}
    assert ranking and not ranking & {"lookup", "suffix", "suffix-2", "none"}  # only drafters that rank
    data = stats.as_dict()
    # (how many rounds the policy gives a model drafter follows this machine's timings)
    assert data["runner_up_rounds"] >= 1 and data["runner_up_leaves"] >= data["runner_up_rounds"]
    assert sum(d["runner_ups"] for d in data["drafters"].values()) == data["runner_up_leaves"]
    assert sum(d["runner_up_won"] for d in data["drafters"].values()) == data["runner_up_wins"]


def test_runner_ups_false_keeps_trees_of_whole_chains_only():
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target)
    drafters = greedy_pool(target, target_lm, ctx)
    policy = build_policy("normalhedge", {"evaluate": "all", "runner_ups": False}, [d.name for d in drafters], seed=0,
                          draft_tokens=5, horizon=60)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(5, 60, SamplingParams()))
    tree = engine.driver.planner.tree
    tree.GAIN, tree.MIN_ROUNDS = 0.0, 1
    assert not engine.driver.wants_runner_ups
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 60)
        assert not any(r.tree.runner_ups for r in records)
    assert not any(tree.runner_up_seen)
