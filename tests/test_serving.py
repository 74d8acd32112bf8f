"""specdraft as a serving engine's proposer, without the engine: the batch planner's draft
lengths, the pool a server can run, and the proposer driven step by step by a simulated
engine that verifies greedily against a known target (rows move, requests finish and
arrive), checked for what it sends, what it learns and what it keeps.

The proposer inside real vLLM is tested in tests/test_vllm.py."""

from __future__ import annotations

import json
import random
import types

import numpy as np
import pytest

from specdraft.errors import ProfileError, UsageError
from specdraft.learning.batch_planner import ALL_ACCEPTED, NO_DRAFT_YET, MatchCalibration
from specdraft.learning.planner import RoundPlanner
from specdraft.profile import load_profile
from specdraft.serving.pool import ServingPool, check_calibration, served_drafters
from specdraft.serving.proposer import SpecdraftProposer, find_runner

VOCAB = 50
POOL = """
[target]
hub = "org/model"

[decode]
draft_tokens = 6

[policy]
name = "{policy}"
{options}

[[drafters]]
name = "suffix"
kind = "suffix"

[[drafters]]
name = "lookup"
kind = "ngram"
"""


def profile_file(tmp_path, policy="normalhedge", options='evaluate = "all"', extra=""):
    file = tmp_path / "pool.toml"
    file.write_text(POOL.format(policy=policy, options=options) + extra)
    return file


def test_the_served_pool_leaves_out_drafters_that_need_the_target_and_says_why(tmp_path):
    layered = profile_file(tmp_path, extra='\n[[drafters]]\nname = "early"\nkind = "layers"\nlayers = 2\n')
    served, left = served_drafters(load_profile(layered))
    assert [d.name for d in served.drafters] == ["suffix", "lookup"]
    assert "early" in left and "KV cache" in left["early"]
    only = tmp_path / "only.toml"
    only.write_text('[target]\nhub = "a/b"\n[[drafters]]\nname = "early"\nkind = "layers"\nlayers = 2\n')
    with pytest.raises(ProfileError, match="no drafter can serve under vLLM"):
        served_drafters(load_profile(only))
    fixed = profile_file(tmp_path, policy="fixed", options='drafter = "early"',
                         extra='\n[[drafters]]\nname = "early"\nkind = "layers"\nlayers = 2\n')
    with pytest.raises(ProfileError, match="policy.drafter"):
        served_drafters(load_profile(fixed))


class SimulatedEngine:
    """vLLM's side of the loop: rows of running requests, greedy verification against a
    deterministic target, the committed tokens handed to `propose` each step."""

    def __init__(self, proposer, target, seed=0, prices=(0.05, 0.002, 0.0)):
        proposer.sim_clock.engine = self
        self.proposer, self.target, self.prices = proposer, target, prices
        self.now = 0.0  # the proposer's clock: each step costs what `prices` say
        self.rows: list[str] = []
        self.text: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.new: dict[str, list[int]] = {}
        self.rng = random.Random(seed)
        self.accepted = self.drafted = 0

    def add(self, req_id, prompt, budget):
        self.rows.append(req_id)
        self.text[req_id], self.budget[req_id] = list(prompt), budget
        self.drafts[req_id] = []
        self.new[req_id] = [self.target(self.text[req_id])]  # the prefill's token
        self.text[req_id].append(self.new[req_id][0])

    def step(self):
        """One engine step: propose over every row (a request that finished in the last step
        still hands over its final tokens, as in vLLM, then leaves the batch unverified)."""
        finished = [r for r in self.rows if len(self.text[r]) >= self.budget[r]]
        self.rng.shuffle(self.rows)  # rows move between steps, as vLLM condenses its batch
        width = max(len(t) for t in self.text.values()) + 16
        ids = np.zeros((len(self.rows) + 2, width), dtype=np.int32)
        for i, r in enumerate(self.rows):
            ids[i, :len(self.text[r])] = self.text[r]
        counts = np.array([len(self.text[r]) for r in self.rows] + [0, 0])
        live = set(self.rows)
        fixed, per_request, per_draft = self.prices
        self.now += fixed + per_request * len(self.rows) + per_draft * sum(len(d) for d in self.drafts.values())
        drafts = self.proposer.propose([self.new[r] for r in self.rows] + [[], []], counts, ids,
                                       request_ids=self.rows + [None, None], live=live)
        assert len(drafts) == len(self.rows) + 2 and drafts[-2:] == [[], []]
        for r, draft in zip(list(self.rows), drafts):
            if r in finished:
                self.rows.remove(r)
                continue
            assert len(draft) <= self.proposer.max_draft
            committed = []
            for token in draft:  # greedy verification: keep drafts equal to the target's choice
                expected = self.target(self.text[r] + committed)
                if token != expected:
                    break
                committed.append(token)
            self.drafts[r] = draft
            self.accepted += len(committed)
            self.drafted += len(draft)
            committed.append(self.target(self.text[r] + committed))  # the bonus token
            self.text[r] += committed
            self.new[r] = committed
        return finished


def copying_target(context):
    """Greedy next token of a target that repeats its prompt's last 12 tokens for ever."""
    return context[len(context) - 12]


def build_proposer(tmp_path, state_file=None, **kwargs):
    pool = ServingPool(load_profile(profile_file(tmp_path, **kwargs)), None, VOCAB, state_file)
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=6))
    clock = types.SimpleNamespace(engine=None)
    proposer = SpecdraftProposer(config, pool=pool, clock=lambda: clock.engine.now if clock.engine else 0.0)
    proposer.sim_clock = clock
    return proposer


@pytest.mark.parametrize("policy, options", [("normalhedge", 'evaluate = "all"'), ("ucb", ""),
                                             ("fixed", 'drafter = "suffix"')])
def test_requests_are_told_apart_as_rows_move_and_finished_ones_are_dropped(tmp_path, policy, options):
    proposer = build_proposer(tmp_path, policy=policy, options=options)
    engine = SimulatedEngine(proposer, copying_target)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(12)] for i in range(6)}
    for i in range(3):
        engine.add(f"r{i}", prompts[f"r{i}"], 70)
    waiting = [f"r{i}" for i in range(3, 6)]
    steps = 0
    while engine.rows or waiting:
        finished = engine.step()
        for _ in finished:
            if waiting:  # a new request arrives as one finishes
                engine.add(waiting[0], prompts[waiting.pop(0)], 70)
        steps += 1
        assert set(proposer.states) <= set(engine.rows) | set(finished)
        assert steps < 500
    engine.step()  # nothing running: every state is dropped
    assert proposer.states == {}
    for r, prompt in prompts.items():  # the simulated verify is greedy: each text is the target's
        text = list(prompt)
        while len(text) < len(engine.text[r]):
            text.append(copying_target(text))
        assert engine.text[r] == text
    assert engine.drafted > 0 and engine.accepted > 0.5 * engine.drafted
    assert proposer.stats["finished"] == 6 and proposer.stats["accepted"] == engine.accepted
    assert steps < 0.6 * 6 * 70 / 3  # speculation committed several tokens a step


def test_a_finished_answer_is_drafted_from_by_the_next_request(tmp_path):
    """The suffix drafter's history is the server's: shared by every request's fork."""
    proposer = build_proposer(tmp_path, policy="fixed", options='drafter = "suffix"')
    noise = random.Random(5)
    table = {}

    def target(context):  # no pattern within one text: only an earlier answer can be copied
        key = tuple(context[-3:])
        if key not in table:
            table[key] = noise.randrange(VOCAB)
        return table[key]

    engine = SimulatedEngine(proposer, target)
    engine.add("first", [1, 2, 3, 4], 60)
    while engine.rows:
        engine.step()
    first = (engine.accepted, engine.drafted)
    engine.add("again", [1, 2, 3, 4], 60)
    while engine.rows:
        engine.step()
    engine.step()
    again = engine.accepted - first[0]
    assert again >= 40  # nearly the whole answer drafted from the first request's text


def test_the_learned_state_outlives_the_server_and_a_foreign_one_is_refused(tmp_path):
    state = tmp_path / "state.json"
    proposer = build_proposer(tmp_path, state_file=state)
    engine = SimulatedEngine(proposer, copying_target)
    engine.add("a", [3, 1, 4, 1, 5, 9, 2, 6], 50)
    while engine.rows:
        engine.step()
    engine.step()
    proposer.pool.save()
    saved = json.loads(state.read_text())
    assert saved["arms"] == ["suffix", "lookup", "none"] and "acceptance" in saved["state"]
    restarted = build_proposer(tmp_path, state_file=state)
    assert restarted.pool.prior == saved
    # the acceptance by match length too: a restarted server prices drafts as it left off
    assert restarted.pool.calibration.state() == saved["serving_calibration"] == proposer.pool.calibration.state()
    assert any(saved["serving_calibration"]["weights"])
    driver = restarted.pool.new_driver()
    assert driver.planner.acceptance.hits == saved["state"]["acceptance"]["hits"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "arms": ["x", "y"]}))
    with pytest.raises(ValueError):
        build_proposer(tmp_path, state_file=other)
    garbled = {**saved, "serving_calibration": {"hits": [[1.0]], "seen": [[1.0]]}}  # an older specdraft's
    other.write_text(json.dumps(garbled))
    with pytest.raises(ValueError, match="serving_calibration.weights"):
        build_proposer(tmp_path, state_file=other)
    served, _ = served_drafters(load_profile(profile_file(tmp_path)))
    check_calibration(served, saved, "state.json")  # `serve` checks it before vLLM starts
    with pytest.raises(UsageError, match="--policy-state other.json: cannot use it"):
        check_calibration(served, garbled, "other.json")
    with pytest.raises(UsageError, match="--policy-state other.json: cannot use it"):  # not even an object
        check_calibration(served, {**saved, "serving_calibration": [1, 2]}, "other.json")


def test_the_runner_is_found_up_the_call_stack():
    class Runner:
        input_batch = types.SimpleNamespace(req_ids=["a"])
        requests = {"a": None}

        def call(self, f):
            return f()

    import sys

    assert isinstance(Runner().call(lambda: find_runner(sys._getframe(0))), Runner)
    with pytest.raises(RuntimeError, match="model runner was not found"):
        find_runner(sys._getframe(0))


def test_drafting_stops_where_a_draft_token_costs_what_a_request_does(tmp_path):
    """The same requests on a step whose draft tokens are free and on one where each costs
    as much as a request: the proposer learns the price from the steps' timings."""
    drafted = {}
    for prices in ((0.05, 0.002, 0.0), (0.0, 0.01, 0.01)):
        proposer = build_proposer(tmp_path)
        engine = SimulatedEngine(proposer, copying_target, prices=prices)
        rng = random.Random(3)
        for i in range(8):
            engine.add(f"r{i}", [rng.randrange(VOCAB) for _ in range(12)], 60)
        while engine.rows:
            engine.step()
        drafted[prices[2]] = engine.drafted
    assert drafted[0.0] > 100 and drafted[0.01] < 0.2 * drafted[0.0]


def test_requests_plan_one_chain_whatever_the_profile_says_of_trees(tmp_path):
    """vLLM verifies one chain per request: the serving pool's drivers run no tree planner."""
    pool = ServingPool(load_profile(profile_file(tmp_path, options='evaluate = "all"\ntree = true')), None, VOCAB, None)
    assert pool.new_driver().planner.tree is None


def test_served_requests_plan_no_round_and_every_offer_teaches_the_calibration(tmp_path, monkeypatch):
    """The batch plan sets draft lengths: a request asks its policy for a drafter only (no
    round planned); every drafter's offer, sent or not, teaches the calibration under the
    outcome of the draft before; a bandit policy's request offers only its choice."""
    def no_round(*args, **kwargs):
        raise AssertionError("a served request planned a round")

    monkeypatch.setattr(RoundPlanner, "plan", no_round)
    seen = []
    observe = MatchCalibration.observe
    monkeypatch.setattr(MatchCalibration, "observe", lambda self, *a: (seen.append(a), observe(self, *a)))
    for policy, options in (("normalhedge", 'evaluate = "all"'), ("ucb", "")):
        proposer = build_proposer(tmp_path, policy=policy, options=options)
        engine = SimulatedEngine(proposer, copying_target, prices=(0.05, 0.002, 0.0))
        rng = random.Random(4)
        for i in range(4):
            engine.add(f"r{i}", [rng.randrange(VOCAB) for _ in range(12)], 60)
        sent_arms = []
        while engine.rows:
            engine.step()
            sent_arms += [s.sent[0].arm for s in proposer.states.values() if s.sent and s.sent[1]]
        assert engine.accepted > 0.5 * engine.drafted > 0
        outcomes = {a[2] for a in seen}
        assert {NO_DRAFT_YET, ALL_ACCEPTED} <= outcomes
        observed_arms = {a[0] for a in seen}
        if policy == "normalhedge":  # both lookups offered every step, whichever was sent
            assert observed_arms == {0, 1}
        else:
            assert observed_arms == set(sent_arms)
        seen.clear()
