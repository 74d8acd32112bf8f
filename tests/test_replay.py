"""Traces and offline replay: a replayed greedy run takes the same rounds as the live run
of the same policy, so policies and parameters can be compared without a model."""

from __future__ import annotations

import pytest

from specdraft.measurement.datasets import Example
from specdraft.profile import load_profile
from specdraft.measurement.replay import replay
from specdraft.runtime import build_runtime
from specdraft.session.prompt_run import PromptRun
from specdraft.measurement.traces import Trace, record_trace

EXAMPLES = [Example("a", "hello there hello there", "copy"), Example("b", "abc", "open"),
            Example("c", "the cat sat on the mat, the cat", "copy")]

POLICIES = [
    ("fixed:half", {}),
    ("fixed:head", {}),
    ("fixed:lookup", {}),
    ("random", {}),
    ("ucb", {"reward": "be"}),
    ("exp3", {"reward": "be"}),
    ("halving", {"reward": "be", "c": 2.0}),
    ("normalhedge", {}),
    ("normalhedge", {"warmup_rounds": 2, "update_every": 3}),
    ("hedge", {"game": "token"}),
    ("ucb", {"reward": "be", "evaluate": "all", "allow_none": True}),
]


# Decisions that do not depend on this machine's timings: the papers' objective and fixed
# draft lengths. (With the goodput objective live rounds follow measured seconds, replayed
# ones the trace's simulated seconds, so the two agree only as far as those do.)
TIMING_FREE = {"objective": "acceptance", "draft_length": "fixed", "allow_none": False}


@pytest.fixture(scope="module")
def traced(tiny_models, tmp_path_factory):
    from conftest import POOL

    from transformers import AutoModelForCausalLM

    from specdraft.drafters.head_model import save_head
    from tiny import random_head

    folder = tmp_path_factory.mktemp("replay")
    target = AutoModelForCausalLM.from_pretrained(tiny_models / "target").double()
    save_head(folder / "head", random_head(target, list(range(0, 259, 3))))
    file = folder / "pool.toml"
    head = f'\n[[drafters]]\nname = "head"\nkind = "head"\npath = "{folder / "head"}"\n'
    file.write_text(POOL.format(root=tiny_models).replace("max_new_tokens = 24", "max_new_tokens = 40\nseed = 3") + head)
    profile = load_profile(file)
    runtime = build_runtime(profile)
    trace = record_trace(runtime, EXAMPLES, chat=False)
    return profile, runtime, trace


def live(profile, runtime, flag, options):
    from dataclasses import replace

    from specdraft.profile import PolicyConfig

    p = profile.with_overrides(policy=flag)
    p = replace(p, policy=PolicyConfig(p.policy.name, dict(p.policy.options) | TIMING_FREE | options))
    rt = build_runtime(p, runtime.target)
    return p.policy, [PromptRun(rt, e.prompt, False).run() for e in EXAMPLES]


@pytest.mark.parametrize("flag, options", POLICIES, ids=[f"{f}{o}" for f, o in POLICIES])
def test_replayed_rounds_match_the_live_run(traced, flag, options):
    profile, runtime, trace = traced
    config, runs = live(profile, runtime, flag, options)
    results = replay(trace, config, seed=3)
    assert replay(trace, config, seed=3) == results  # deterministic
    for run, result in zip(runs, results):
        assert result.tokens == run.stats.tokens
        assert result.rounds == run.stats.rounds, (flag, options)
        assert result.tokens_per_round == pytest.approx(run.stats.tokens_per_round)
        if run.stats.regret is not None:
            assert result.regret == pytest.approx(run.stats.regret, abs=1e-6)
            assert result.best_drafter == run.stats.best_drafter


def test_trace_round_trips_through_its_file(traced, tmp_path):
    _, _, trace = traced
    trace.save(tmp_path / "t.jsonl")
    again = Trace.load(tmp_path / "t.jsonl")
    assert again == trace
    assert set(trace.header.costs) == {"target", "lookup", "small", "half", "head", "none"}
    assert trace.header.costs["target"](1) > 0
    assert trace.header.costs["head"](1) > 0  # timed by the head itself: not a causal LM
    assert trace.header.costs["half"](1) > 0  # the target's first layers: timed over a twin of its cache


def test_trace_records_the_plain_greedy_trajectory(traced):
    profile, runtime, trace = traced
    plain = build_runtime(profile, runtime.target, plain=True)
    for example, prompt in zip(EXAMPLES, trace.prompts):
        assert prompt.tokens == PromptRun(plain, example.prompt, False).run().detokenizer.ids
        lookup = prompt.drafters["lookup"]
        assert all(r <= d for r, d in zip(lookup.run, lookup.drafted))


def test_live_and_replayed_rounds_go_through_the_same_policy_driver(traced, monkeypatch):
    """Both paths must drive the policy through PolicyDriver, so they cannot drift apart."""
    from specdraft.learning.driver import PolicyDriver

    profile, runtime, trace = traced
    calls = {"choose": 0, "finish_round": 0}
    for method in calls:
        original = getattr(PolicyDriver, method)

        def counted(self, *args, _original=original, _name=method, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(PolicyDriver, method, counted)
    config, runs = live(profile, runtime, "normalhedge", {"update_every": 2})
    live_rounds = sum(run.stats.rounds for run in runs)
    assert calls == {"choose": live_rounds, "finish_round": live_rounds}
    calls.update(choose=0, finish_round=0)
    results = replay(trace, config, seed=3)
    replayed_rounds = sum(r.rounds for r in results)
    assert calls == {"choose": replayed_rounds, "finish_round": replayed_rounds}


def test_replayed_trees_commit_the_longest_lane_run(traced, monkeypatch):
    """A plan with branches replays every branch's lane: the round commits the longest run
    of its chains + 1, and the rounds still cover the traced text exactly."""
    from dataclasses import replace as replaced

    from specdraft.learning.driver import PolicyDriver
    from specdraft.profile import PolicyConfig

    _, _, trace = traced
    arms = [name for name in trace.header.drafters if name != "none"]
    lookup = arms.index("lookup")
    choose = PolicyDriver.choose
    committed = []

    def with_every_branch(self, produced, awake=None):
        plan = choose(self, produced, awake)
        depth = max(1, min(4, self.max_new_tokens - produced - 1))
        return replaced(plan, arm=lookup, draft_tokens=depth,
                        branches=tuple((i, depth) for i in range(len(arms)) if i != lookup))

    monkeypatch.setattr(PolicyDriver, "choose", with_every_branch)
    config = PolicyConfig("normalhedge", {"evaluate": "all", "allow_none": False})
    for prompt, result in zip(trace.prompts, replay(trace, config, seed=3)):
        assert result.tokens == len(prompt.tokens)
        position = rounds = 0
        won = {}
        while position < len(prompt.tokens):  # what every round must have committed
            depth = max(1, min(4, trace.header.max_new_tokens - position - 1))
            order = [arms[lookup], *(a for a in arms if a != arms[lookup])]  # the chosen chain first
            runs = [min(prompt.drafters[a].run[position], prompt.drafters[a].drafted[position], depth) for a in order]
            if max(runs):  # the furthest chain won, the first of equals
                won[order[runs.index(max(runs))]] = won.get(order[runs.index(max(runs))], 0) + 1
            position += min(max(runs) + 1, len(prompt.tokens) - position)
            rounds += 1
        committed.append((result.rounds, rounds))
        assert (result.tree_rounds, result.branches, result.won) == (rounds, rounds * len(arms), won)
        assert result.branched == {a: rounds for a in arms}
    assert all(got == want for got, want in committed), committed


@pytest.mark.parametrize("flag, options", [("normalhedge", {"evaluate": "all", "tree": True}),
                                           ("ucb", {"reward": "be"}), ("fixed:lookup", {}), ("fixed:head", {})])
def test_no_replayed_policy_beats_the_pools_hindsight(traced, flag, options):
    """Per task and overall, a replayed policy's simulated speedup (trees and the plain arm
    included) stays at or below the pool's best rounds in hindsight, and a fixed drafter's
    at or below its own."""
    from specdraft.measurement.replay import hindsight
    from specdraft.profile import PolicyConfig

    _, _, trace = traced
    bounds = {b.task: b for b in hindsight(trace)}
    name, _, drafter = flag.partition(":")
    results = replay(trace, PolicyConfig(name, ({"drafter": drafter} if drafter else {}) | options), seed=1)
    for task, bound in bounds.items():
        chosen = [r for r in results if task == "all" or r.task == task]
        speedup = sum(r.plain_simulated_s for r in chosen) / sum(r.simulated_s for r in chosen)
        assert speedup <= bound.pool * (1 + 1e-9)
        if drafter:
            assert speedup <= bound.drafters[drafter] * (1 + 1e-9)
        assert bound.pool >= max(bound.drafters.values()) * (1 - 1e-12)


@pytest.mark.parametrize("kind, own_forward, charged", [("layers", None, False), ("model", None, True),
                                                        ("layers", [False, True], True),
                                                        ("model", [False, False], False)])
def test_full_information_replay_charges_catch_up_only_for_drafters_scored_by_their_own_forward(
        kind, own_forward, charged):
    """A self-drafter ("layers") is scored from the verify's hidden states, not by a forward
    of its own: a full-information replay charges it no catch-up (the trace says so, or its
    kind does in traces from before the trace recorded it)."""
    from specdraft.drafters.base import TrajectoryScores
    from specdraft.measurement.traces import ForwardCost, PromptTrace, TraceHeader
    from specdraft.profile import PolicyConfig

    costs = {"target": ForwardCost(1.0, 0.1), "a": ForwardCost(0.0, 0.0), "x": ForwardCost(100.0, 0.0),
             "none": ForwardCost(0.0, 0.0)}
    header = TraceHeader(3, 8, ["a", "x", "none"], ["ngram", kind, "none"], costs,
                         scored_by_own_forward=own_forward and [*own_forward, False])
    n = 8
    lanes = {"a": TrajectoryScores([1.0] * n, [3] * n, [3] * n, [[1.0] * 3] * n),
             "x": TrajectoryScores([0.0] * n, [0] * n, [0] * n, [[]] * n),
             "none": TrajectoryScores([0.0] * n, [0] * n, [0] * n, [[]] * n)}
    trace = Trace(header, [PromptTrace("p", "t", 2, list(range(n)), lanes)])
    (result,) = replay(trace, PolicyConfig("normalhedge", {"evaluate": "all"}), seed=0)  # the plain arm too
    assert result.rounds >= 1 and (result.simulated_s >= 100.0 * result.rounds) == charged


def test_a_trace_times_the_target_at_every_verify_width_and_replay_pads_as_live_rounds_do(traced, tmp_path):
    """The target's forward is timed at widths 1 .. K + 1; a verify of n tokens is priced at
    the cheapest timed width >= n (live rounds pad to it), past them by the line."""
    from specdraft.measurement.traces import ForwardCost

    _, _, trace = traced
    target = trace.header.costs["target"]
    assert len(target.by_width) == trace.header.draft_tokens + 1 and all(t > 0 for t in target.by_width)
    assert all(cost.by_width is None for name, cost in trace.header.costs.items() if name != "target")
    trace.save(tmp_path / "t.jsonl")
    assert Trace.load(tmp_path / "t.jsonl").header.costs["target"] == target

    cost = ForwardCost(1.0, 0.5, [1.0, 2.0, 1.8, 3.0])
    assert [cost(n) for n in range(6)] == [0.0, 1.0, 1.8, 1.8, 3.0, 3.5]
    assert ForwardCost(1.0, 0.5, [1.0, 2.0, 1.8, 3.0, 4.0])(6) == 4.0  # never below the last width timed
    assert ForwardCost(1.0, 0.5)(3) == 2.5  # traces from before: the line
