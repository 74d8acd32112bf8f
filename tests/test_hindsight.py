"""The hindsight bound (`specdraft/measurement/hindsight.py`): the exact best sequence of
rounds, checked against enumerating every sequence on small trajectories, and, through
benchmarks/tree_potential.py's replay, its claim to bound every static tree."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import random

import pytest

from specdraft.measurement.hindsight import best_rate

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tree_potential.py"
_SPEC = importlib.util.spec_from_file_location("tree_potential", _PATH)
tree_potential = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tree_potential)

WIDTHS = [1.0, 1.1, 1.15, 1.3, 1.6, 1.9]


def random_prompt(rng: random.Random, n: int, names: list[str], cap: int) -> dict:
    lanes = {}
    for name in names:
        drafted = [rng.randint(0, cap) for _ in range(n)]
        run = [rng.randint(0, d) for d in drafted]
        lanes[name] = {"drafted": drafted, "run": run}
    return {"id": "t-0", "tokens": list(range(n)), "drafters": lanes}


def best_by_enumeration(prompts, names, cost, per_token, cap, any_length) -> float:
    """Every sequence of rounds through every prompt, the best tokens per step of all."""
    def paths(prompt, position):
        n = len(prompt["tokens"])
        if position >= n:
            yield 0.0, 0.0
            return
        for m in names:
            lane = prompt["drafters"][m]
            drafted = min(lane["drafted"][position], cap)
            for k in range(drafted + 1) if any_length else {0, drafted}:
                step = min(n - position, min(lane["run"][position], k) + 1)
                seconds = cost(1 + k) + per_token[m] * k
                for tokens, rest in paths(prompt, position + step):
                    yield step + tokens, seconds + rest
    per_prompt = [list(paths(p, 0)) for p in prompts]
    return max(sum(t for t, _ in combo) / sum(s for _, s in combo) for combo in itertools.product(*per_prompt))


def test_best_rate_is_the_best_sequence_of_rounds_of_any_options():
    rng = random.Random(11)
    for trial in range(20):
        prompts = []
        for _ in range(rng.randint(1, 3)):
            table = [[(rng.randint(1, 4), rng.uniform(0.5, 3.0)) for _ in range(rng.randint(1, 3))]
                     for _ in range(rng.randint(1, 6))]
            prompts.append((len(table), table.__getitem__))

        def paths(length, options, position):
            if position >= length:
                yield 0.0, 0.0
                return
            for tokens, seconds in options(position):
                step = min(tokens, length - position)
                for rest_tokens, rest_seconds in paths(length, options, position + step):
                    yield step + rest_tokens, seconds + rest_seconds
        exact = max(sum(t for t, _ in combo) / sum(s for _, s in combo)
                    for combo in itertools.product(*(list(paths(n, o, 0)) for n, o in prompts)))
        assert best_rate(prompts) == pytest.approx(exact, rel=1e-9)
        assert best_rate(prompts, at_least=0.7 * exact) == pytest.approx(exact, rel=1e-9)  # a head start


@pytest.mark.parametrize("any_length", [True, False])
def test_the_hindsight_rate_is_the_best_sequence_of_rounds(any_length):
    rng = random.Random(3)
    cost = tree_potential.width_cost(WIDTHS)
    names = ["a", "b"]
    for trial in range(6):
        prompts = [random_prompt(rng, rng.randint(3, 6), names, 3) for _ in range(2)]
        per_token = {"a": 0.0, "b": rng.choice([0.0, 0.2])}
        exact = best_by_enumeration(prompts, names, cost, per_token, 3, any_length)
        assert tree_potential.hindsight_rate(prompts, names, cost, per_token, 3, any_length) \
            == pytest.approx(exact, rel=1e-9)


def test_no_static_tree_beats_the_pools_hindsight_rate():
    rng = random.Random(5)
    cost = tree_potential.width_cost(WIDTHS)
    names = ["a", "b", "c"]
    per_token = {"a": 0.0, "b": 0.0, "c": 0.3}
    prompts = [random_prompt(rng, 40, names, 6) for _ in range(4)]
    bound = tree_potential.hindsight_rate(prompts, names, cost, per_token, 6, True)
    for size in (1, 2, 3):
        for members in itertools.combinations(names, size):
            for caps in itertools.product((1, 3, 6), repeat=size):
                tokens, seconds, _, _ = tree_potential.replay(prompts, list(zip(members, caps)), cost, per_token)
                assert tokens / seconds <= bound + 1e-12
    singles = [tree_potential.hindsight_rate(prompts, [m], cost, per_token, 6, True) for m in names]
    assert max(singles) < bound  # two random drafters are right in different rounds


def test_a_traces_hindsight_prices_rounds_as_the_replay_does():
    """Target forward of w tokens: 1 + 0.1 w seconds; drafter a: 0.2 s a drafted token. At
    position 0 a drafts 3 tokens, all right: one round of 4 tokens in 1.4 + 0.6 s, against a
    plain step of 1.1 s per token, is 2.2x; b never drafts (1.0x)."""
    from specdraft.drafters.base import TrajectoryScores
    from specdraft.measurement.replay import hindsight
    from specdraft.measurement.traces import ForwardCost, PromptTrace, Trace, TraceHeader

    costs = {"target": ForwardCost(1.0, 0.1), "a": ForwardCost(0.2, 0.0), "b": ForwardCost(0.0, 0.0)}
    header = TraceHeader(3, 4, ["a", "b", "none"], ["ngram", "ngram", "none"], costs)
    lanes = {"a": TrajectoryScores([1.0] * 4, [3, 0, 0, 0], [3, 0, 0, 0], [[1.0] * 3, [], [], []]),
             "b": TrajectoryScores([0.0] * 4, [0] * 4, [0] * 4, [[]] * 4)}
    (bound,) = hindsight(Trace(header, [PromptTrace("p", "t", 2, [5, 6, 7, 8], lanes)]))
    assert bound.task == "all" and bound.best == "a"
    assert bound.drafters == {"a": pytest.approx(2.2), "b": pytest.approx(1.0)}
    assert bound.pool == pytest.approx(2.2)
