"""The resident server's runtimes per sampling rule: the server's own for its profile's rule,
one built beside it (sharing the target's weights) for another, the few most recent kept,
a value out of a profile's range refused naming the request's key."""

from __future__ import annotations

import pytest

from specdraft.profile import load_profile
from specdraft.runtime import build_runtime
from specdraft.serving.sampling_rules import KEPT, RuleError, RuntimesByRule


@pytest.fixture(scope="module")
def rules(tiny_models, tmp_path_factory):
    from conftest import POOL

    file = tmp_path_factory.mktemp("rules") / "pool.toml"
    file.write_text(POOL.format(root=tiny_models))
    return RuntimesByRule(build_runtime(load_profile(file)))


def test_the_servers_rule_decodes_on_the_servers_runtime(rules):
    assert rules.runtime_for(()) is rules.server
    assert rules.runtime_for((("temperature", 0.0), ("top_p", 1.0))) is rules.server
    assert rules.runtime_for((("top_p", 0.5), ("top_k", 3))) is rules.server  # greedy: they change nothing


def test_another_rule_gets_its_own_runtime_sharing_the_target(rules):
    warm = rules.runtime_for((("temperature", 0.7), ("seed", 3)))
    assert warm is not rules.server and warm.target is rules.server.target
    assert warm.engine.settings.sampling.temperature == 0.7 and warm.engine.target is not rules.server.engine.target
    assert rules.runtime_for((("temperature", 0.7),)) is warm  # kept for the next request at that rule
    penalised = rules.runtime_for((("repeat_penalty", 1.2),))
    assert penalised.engine.settings.penalty.factor == 1.2 and penalised.engine.settings.sampling.greedy
    for t in (0.5, 0.6, 0.8, 0.9):
        rules.runtime_for((("temperature", t),))
    assert len(rules.others) == KEPT and rules.runtime_for((("temperature", 0.7),)) is not warm


def test_seeded_requests_draw_the_same_first_token(rules):
    draws = []
    for _ in range(2):
        runtime = rules.runtime_for((("temperature", 1.0), ("seed", 11)))
        draws.append(int(__import__("torch").rand(1, generator=runtime.engine.generator) * 1e6))
    assert draws[0] == draws[1]


@pytest.mark.parametrize("sampling, key", [((("temperature", 0.0001),), "temperature"), ((("top_p", 1.5),), "top_p"),
                                           ((("repeat_penalty", 0.0),), "repeat_penalty"), ((("top_k", -1),), "top_k")])
def test_values_out_of_range_name_the_requests_key(rules, sampling, key):
    with pytest.raises(RuleError, match=f"^{key} must"):
        rules.runtime_for(sampling)
