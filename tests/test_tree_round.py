"""The tree round: several drafters' chains merged into one token tree, verified in one
forward, committing exactly what plain greedy decoding commits and, under sampling, tokens
that follow the target's distribution (multi-draft speculative sampling); the feedback
stays exact; the tree planner adds a branch only where it is estimated to pay."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from specdraft.core.sampling import SamplingParams
from specdraft.core.tree import TokenTree
from specdraft.core.verify import verify_tree_sampling
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, PlainDecoding, SuffixDrafter
from specdraft.drafters.head import HeadDrafter
from specdraft.drafters.layers import LayersDrafter, truncated_view
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.goodput import RoundCostModel
from specdraft.learning.policies import build_policy
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.learning.tree_planner import TreePlanner, run_length
from specdraft.models.cached_lm import CachedLM
from test_sampling import P_MIN, SAMPLING_PROMPT, assert_follows_laws, chi_square_p, pair_and_third_laws, sampling_pool
from tiny import VOCAB, plain_greedy, random_head, tiny_llama

PROMPTS = [[5, 9, 14, 9, 14, 22, 5, 9, 14], [3, 3, 7, 11, 3, 3, 7], [40, 41, 42, 43, 40, 41]]


def scripted_branches(engine: SpeculativeEngine, seed: int, most: int = 3, deepest: int = 4, least: int = 1) -> None:
    """Every round's plan gets `least`..`most` random branches of other drafters, each 1..`deepest`
    deep and never past the budget, as the planner's (drawn from their own random stream,
    never from the target's)."""
    rng = random.Random(seed)
    choose = engine.driver.choose

    def with_branches(produced, awake=None):
        plan = choose(produced, awake)
        cap = min(deepest, engine.settings.max_new_tokens - produced - 1)
        if cap < 1:
            return plan
        others = [i for i in range(len(engine.drafters)) if i != plan.arm]
        picked = rng.sample(others, rng.randint(least, min(most, len(others))))
        return replace(plan, branches=tuple((i, rng.randint(1, cap)) for i in picked))

    engine.driver.choose = with_branches


def greedy_pool(target, target_lm, ctx):
    return [NgramDrafter("lookup", ctx, 1, 3),
            ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1)),
            ModelDrafter("half", ctx, truncated_view(target, 2)),
            ModelDrafter("twin", ctx, target),  # the target itself: its chain is always accepted
            ModelDrafter("twin-again", ctx, target),  # the same chain again: merged row for row
            SuffixDrafter("suffix", ctx, SuffixOptions()),
            SuffixDrafter("suffix-2", ctx, SuffixOptions(rank=2, min_prob=0.0)),  # the second continuation
            LayersDrafter("shared", ctx, target_lm, 2),  # drafts over the target's own cache
            HeadDrafter("head", ctx, random_head(target, list(range(VOCAB))), target),
            PlainDecoding(ctx)]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("policy", ["random", "normalhedge"])
def test_scripted_trees_commit_what_plain_greedy_decoding_commits(policy, static):
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target, static=static)
    drafters = greedy_pool(target, target_lm, ctx)
    options = {"evaluate": "all"} if policy == "normalhedge" else {}
    chosen = build_policy(policy, options, [d.name for d in drafters], seed=0, draft_tokens=5, horizon=40)
    engine = SpeculativeEngine(target_lm, drafters, chosen, EngineSettings(5, 40, SamplingParams()))
    scripted_branches(engine, seed=3)
    shapes = Counter()
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 40)
        # the target's cache holds the committed text less the last token, the next verify's input
        assert target_lm.length == len(prompt) + 40 - 1
        for r in records:
            shapes[(len(r.tree.branches), r.tree.tree_size)] += 1
            assert r.tree.tree_size <= sum(drafted for _, drafted, _ in r.tree.branches)
            assert all(kept <= drafted for _, drafted, kept in r.tree.branches)
            assert r.accepted == max(kept for _, _, kept in r.tree.branches)
            assert (r.tree.winner is None) == (r.accepted == 0)
    assert len(shapes) >= 8 and sum(n for (branches, _), n in shapes.items() if branches >= 3) >= 10


def test_a_model_drafter_that_branched_keeps_only_its_committed_tokens():
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    small = ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))
    drafters = [NgramDrafter("lookup", ctx, 1, 3), small]
    engine = SpeculativeEngine(CachedLM(target), drafters, RandomPolicy(["lookup", "small"], seed=1),
                               EngineSettings(4, 30, SamplingParams()))
    scripted_branches(engine, seed=5, most=1)
    context = list(PROMPTS[0])
    for record in engine.generate(PROMPTS[0]):
        context.extend(record.tokens)
        kept = dict((name, n) for name, _, n in record.tree.branches)
        if "small" in kept and record.finish is None:
            # its cache: the text before the round, then its drafts that were committed
            start = len(context) - len(record.tokens)
            assert small.lm.length <= start + kept["small"]


def test_tree_gammas_equal_the_chain_rounds_gammas_at_every_position():
    """A drafter's gamma at a position depends only on the committed text: evaluation after
    tree rounds (which reuses each branch's own alignment) must give what it gives after
    one-chain rounds."""
    target = tiny_llama(seed=0)
    by_position = []
    for scripted in (False, True):
        ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
        drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1)),
                    ModelDrafter("half", ctx, truncated_view(target, 2))]
        policy = build_policy("normalhedge", {"evaluate": "all", "objective": "acceptance", "tree": False,
                                              "update_every": 1},
                              [d.name for d in drafters], seed=0, draft_tokens=4, horizon=40)
        engine = SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(4, 40, SamplingParams()))
        if scripted:
            scripted_branches(engine, seed=2)
        gammas = {}
        position = 0
        for record in engine.generate(PROMPTS[1]):
            for arm_gammas in (record.learning.gammas,):
                for j in range(len(record.tokens)):
                    gammas[position + j] = [None if g is None else round(g[j], 9) for g in arm_gammas]
            position += len(record.tokens)
        by_position.append(gammas)
    assert by_position[0] == by_position[1]


def test_multi_draft_sampling_commits_tokens_distributed_as_p():
    """At one node: drafts offered by several chains in turn (one-hot and sampled ones, the
    same token twice) leave the committed token distributed exactly as p."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, -1)
    qs = [torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, -1) for _ in range(2)]
    counts, n_draws = Counter(), 8000
    for _ in range(n_draws):
        a, b = (int(torch.multinomial(q, 1, generator=gen)) for q in qs)
        chains = [[a], [b], [3], [3]]  # two sampled drafts, the same one-hot token twice
        tree = TokenTree.merge(0, chains)
        probs = p.expand(len(tree), vocab).clone()
        _, tokens = verify_tree_sampling(tree, probs, [qs[0].view(1, -1), qs[1].view(1, -1), None, None], gen)
        counts[tokens[0]] += 1
    assert chi_square_p(counts, {v: float(p[v]) for v in range(vocab)}, n_draws) > P_MIN


def test_sampled_tree_rounds_follow_the_target():
    """Three tokens generated with trees of three or four drafters every round that may
    draft (sampled, one-hot, over the target's cache, from its features, int8) follow the
    target's joint law."""
    params = SamplingParams(1.0)
    target, target_lm, gen, drafters = sampling_pool(params)
    prompt = SAMPLING_PROMPT
    policy = RandomPolicy([d.name for d in drafters], seed=2)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(3, 3, params), gen)
    scripted_branches(engine, seed=4, most=3, deepest=3, least=2)
    joint2, marginal3 = pair_and_third_laws(target, prompt, params)
    generations, trees = Counter(), Counter()

    def count_trees(records):
        generations["n"] += 1
        trees["n"] += sum(len(r.tree.branches) >= 3 for r in records)

    assert_follows_laws(engine, prompt, joint2, marginal3, count_trees)
    assert trees["n"] >= generations["n"]  # (every first round at least)


# --- the planner ----------------------------------------------------------------------------

def planner_with(costs_per_width, draft_costs):
    costs = RoundCostModel(len(draft_costs))
    costs.verify.install(costs_per_width)
    costs.draft = list(draft_costs)
    return TreePlanner(["a", "b", "c", "none"], [False, False, False, True], costs)


def test_run_length_is_the_leading_run_or_its_expectation():
    assert run_length([1.0, 1.0, 0.0, 1.0]) == 2.0
    assert run_length([0.5, 0.5]) == pytest.approx(0.75)


def test_a_branch_is_planned_where_another_drafter_is_right_when_the_chosen_one_is_not():
    planner = planner_with([1.0] * 4 + [1.5] * 12, [0.01, 0.01, 0.01, 0.0])
    for t in range(40):  # a and b take turns being right for 4 tokens; c agrees with a
        a_right = t % 2 == 0
        runs = [4.0, 0.0, 4.0] if a_right else [0.0, 4.0, 0.0]
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
    plan = planner.branches(0, 4, 8, None)
    assert plan is not None and plan[0][0][0] == 1  # b, not c (which only repeats a)
    branches, leaves, expected, seconds = plan
    assert leaves == ()  # no runner-up verdicts yet
    assert expected == pytest.approx(5.0) and len(branches) == 1


def test_no_branch_where_the_drafters_agree_or_the_verify_would_cost_too_much():
    agree = planner_with([1.0] * 16, [0.01, 0.01, 0.01, 0.0])
    for _ in range(40):
        agree.observe([[1.0, 1.0, 0.0]] * 3 + [None], None)
    assert agree.branches(0, 4, 8, None) is None
    dear = planner_with([1.0 + w for w in range(16)], [0.01, 0.01, 0.01, 0.0])  # every row costs a step
    for t in range(40):
        runs = [1.0, 0.0, 0.0] if t % 2 else [0.0, 1.0, 0.0]
        dear.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
    assert dear.branches(0, 1, 8, None) is None


def test_asleep_and_unmeasured_drafters_get_no_branch():
    planner = planner_with([1.0] * 16, [0.01, 0.01, None, 0.0])
    for t in range(40):
        runs = [4.0, 0.0, 0.0] if t % 2 else [0.0, 4.0, 4.0]
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
    assert planner.branches(0, 4, 8, [True, False, True, True]) is None  # b asleep, c's cost unknown
    assert planner.branches(0, 4, 8, None)[0][0][0] == 1


def test_replanning_waits_longer_while_no_branch_pays_and_comes_back_when_one_does(monkeypatch):
    planner = planner_with([1.0] * 16, [0.01, 0.01, 0.01, 0.0])
    for _ in range(40):  # the drafters agree: no branch pays
        planner.observe([[1.0, 1.0, 0.0]] * 3 + [None], None)
    planned = []
    plan = planner._plan
    monkeypatch.setattr(planner, "_plan", lambda *args: planned.append(args) or plan(*args))
    for _ in range(200):
        assert planner.branches(0, 4, 8, None) is None
    # Replanned at rounds 8, 24, 56, 120 and 184 (waits 8, 16, 32, 64, 64), not every 8th.
    assert len(planned) == 6
    for t in range(48):  # now b is right where a is not: the next replan finds the branch ...
        runs = [4.0, 0.0, 4.0] if t % 2 == 0 else [0.0, 4.0, 0.0]
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], None)
    rounds = 0
    while planner.branches(0, 4, 8, None) is None:
        rounds += 1
    assert rounds < planner.MAX_REPLAN
    planned.clear()  # ... and from then on plans are renewed every REPLAN rounds again
    for _ in range(3 * planner.REPLAN):
        planner.branches(0, 4, 8, None)
    assert len(planned) == 3


@pytest.mark.parametrize("name", ["normalhedge", "hedge", "exp3"])
def test_the_policies_own_trees_keep_greedy_output_identical(name):
    """Trees as the planner plans them (made eager to branch here), under the policies."""
    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target)
    drafters = greedy_pool(target, target_lm, ctx)
    policy = build_policy(name, {"evaluate": "all"}, [d.name for d in drafters], seed=0, draft_tokens=5, horizon=60)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(5, 60, SamplingParams()))
    tree = engine.driver.planner.tree
    if not policy.full_information:
        assert tree is None  # bandit feedback: one chain a round
        return
    tree.GAIN, tree.MIN_ROUNDS = 0.0, 1  # every branch that has a rate at all
    rounds = 0
    for prompt in PROMPTS:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 60)
        rounds += sum(len(r.tree.branches) > 1 for r in records)
    assert rounds >= 10


def test_stats_json_and_panel_show_trees_and_whose_branch_won():
    from rich.console import Console

    from specdraft.session.stats import GenerationStats
    from specdraft.ui.panel import stats_panel

    target = tiny_llama(seed=0)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("twin", ctx, target),
                ModelDrafter("small", ctx, tiny_llama(seed=1, layers=1))]
    engine = SpeculativeEngine(CachedLM(target), drafters, RandomPolicy(["lookup", "twin", "small"], seed=0),
                               EngineSettings(4, 30, SamplingParams()))
    scripted_branches(engine, seed=1, most=2)
    stats = GenerationStats(["lookup", "twin", "small"])
    records = list(engine.generate(PROMPTS[0]))
    for record in records:
        stats.add(record)
    trees = [r for r in records if len(r.tree.branches) > 1]
    data = stats.as_dict()
    assert data["tree_rounds"] == len(trees) > 0
    assert data["branches_per_round"] == pytest.approx(sum(len(r.tree.branches) for r in records) / len(records), abs=1e-4)
    assert sum(d["won"] for d in data["drafters"].values()) == sum(r.tree.winner is not None for r in trees)
    assert data["drafters"]["twin"]["won"] >= 1  # the target's own chain wins whenever it branches
    assert sum(data["draft_lengths"].values()) == len(records)
    console = Console(width=200, record=True)
    stats.last_branches, stats.last_tree_size, stats.last_winner = 3, 7, "twin"
    console.print(stats_panel(stats, "random"))
    text = console.export_text()
    assert "tree 7 (3 branches, won by twin)" in text and "branched" in text and "won" in text


def test_a_drafter_is_judged_on_the_rounds_it_was_awake_in():
    """b finds a match in one round of four, and then it is right where a is not: while it
    is awake a branch of b pays, judged on those rounds (asleep is not a run of 0)."""
    planner = planner_with([1.0] * 4 + [1.2] * 12, [0.01, 0.01, 0.01, 0.0])
    for t in range(48):
        awake = t % 4 == 0
        runs = [0.0, 4.0 if awake else 0.0, 0.0]
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], [False, not awake, False, False])
    plan = planner.branches(0, 2, 8, [True, True, True, True])
    assert plan is not None and plan[0][0][0] == 1 and plan[2] == pytest.approx(5.0)


def test_a_branch_is_judged_against_the_chain_on_the_same_rounds():
    """b is awake only where a runs long too (the easy stretches): on those rounds b adds
    nothing to a, so no branch, though a's rate over all rounds is far lower."""
    planner = planner_with([1.0] * 16, [0.01, 0.01, 0.01, 0.0])
    for t in range(48):
        awake = t % 4 == 0
        runs = [4.0 if awake else 0.0, 4.0 if awake else 0.0, 0.0]
        planner.observe([[1.0] * int(r) + [0.0] for r in runs] + [None], [False, not awake, True, False])
    assert planner.branches(0, 4, 8, [True, True, False, True]) is None


def test_a_tree_rounds_verify_teaches_its_own_overhead_not_the_chain_curve():
    costs = RoundCostModel(2)
    costs.verify.install([0.010, 0.011, 0.012, 0.013])
    costs.observe(0, 2, 0.002, 0.012, 3)  # a chain of width 3 as the curve says
    scale = costs.verify.scale
    for _ in range(5):
        costs.observe(0, 2, 0.002, 0.015, 4, branch_drafts=((1, 1, 0.001),))  # a tree of 4 rows, 2 ms over
    assert costs.verify.scale == scale and costs.tree_extra == pytest.approx(0.002, rel=0.01)
    assert costs.draft[1] == pytest.approx(0.001)
