"""The static KV cache and CUDA-graph replay give the same greedy output as the dynamic
cache, for every drafter kind, with rollbacks, growth past the capacity and drafters that
write into the target's cache. Graph capture is faked on CPU by a capture that replays by
re-running the forward on the captured buffers: everything but the driver call is real."""

from __future__ import annotations

import logging

import pytest
import torch

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter
from specdraft.drafters.layers import LayersDrafter
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.models import kv_cache
from specdraft.models.cached_lm import CachedLM
from specdraft.models.cuda_graphs import GraphedForward
from specdraft.models.kv_cache import core_choice
from tiny import VOCAB, plain_greedy, tiny_llama

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [17]]


class FakeCapture:
    """Stands in for CUDA's capture: runs the forward once to get output buffers (then takes
    its cache writes back, as a real capture never makes them) and replays by running it
    again and copying the results into those same buffers."""

    def __init__(self, lm: CachedLM, fail: bool = False):
        self.lm, self.fail = lm, fail
        self.captures = self.replays = 0

    def __call__(self, run):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        logits, hidden = run()
        width = self.lm.cache.layers[0].cumulative_length.item() - self.lm.length
        self.lm.kv.remove_last(width, length=self.lm.length + width)

        def replay():
            self.replays += 1
            new_logits, new_hidden = run()
            logits.copy_(new_logits)
            for layer, h in new_hidden.items():
                hidden[layer].copy_(h)

        return replay, (logits, hidden)


def graphed(model, fail=False) -> tuple[CachedLM, FakeCapture]:
    lm = CachedLM(model, static=True)
    capture = FakeCapture(lm, fail)
    lm.graphs = GraphedForward(lm.eager_forward, lm.device, capture)
    return lm, capture


def pool(target_lm, ctx, drafter_model, static):
    drafter_lm = CachedLM(drafter_model, logits_size=VOCAB, static=static)
    return [NgramDrafter("lookup", ctx, 1, 3),
            ModelDrafter("small", ctx, drafter_model, lm=drafter_lm),
            LayersDrafter("half", ctx, target_lm, 2)]  # writes into the target's own (static) cache


@pytest.mark.parametrize("capacity", [None, 8])  # 8: the cache grows (and is copied) mid-prompt
@pytest.mark.parametrize("k", [1, 4])
def test_static_cache_matches_plain_greedy_for_every_drafter(monkeypatch, capacity, k):
    if capacity:
        monkeypatch.setattr(kv_cache, "STATIC_CAPACITY", capacity)
    target, small = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm = CachedLM(target, static=True)
    drafters = pool(target_lm, ctx, small, static=True)
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=1),
                               EngineSettings(k, 30, SamplingParams()))
    for prompt in PROMPTS:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 30)
    assert target_lm.kv.capacity >= 30 and (capacity is None or target_lm.kv.capacity > capacity)


def test_graph_replay_matches_plain_greedy_and_is_used():
    target, small = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm, target_capture = graphed(target)
    drafter_lm, drafter_capture = graphed(small)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("small", ctx, small, lm=drafter_lm),
                LayersDrafter("half", ctx, target_lm, 2)]
    policy = RandomPolicy([d.name for d in drafters], {"draft_length": "fixed"}, seed=2)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(3, 40, SamplingParams()))
    for prompt in PROMPTS * 2:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 40)
    # a handful of shapes (verify widths 1..4, the prefill's last step) captured once each, replayed
    assert 1 <= target_capture.captures <= 8 and target_capture.replays > 2 * target_capture.captures
    assert drafter_capture.replays > 10


def test_graphs_hand_over_hidden_states_like_an_eager_forward():
    model = tiny_llama(seed=0)
    eager, (lm, _) = CachedLM(model), graphed(model)
    tokens = torch.tensor([5, 9, 11, 3, 7])
    for ref in (eager, lm):
        ref.feed(tokens, keep=1)
    for _ in range(3):  # eager warm-up, capture + replay, replay
        want = eager.feed_with_hidden(torch.tensor([4, 8]), 0, (1, 3))
        got = lm.feed_with_hidden(torch.tensor([4, 8]), 0, (1, 3))
        torch.testing.assert_close(got[0], want[0])
        for layer in (1, 3):
            torch.testing.assert_close(got[1][layer], want[1][layer])
        eager.crop(eager.length - 1)
        lm.crop(lm.length - 1)


def test_a_failed_capture_falls_back_to_eager_with_one_warning(caplog):
    target = tiny_llama(seed=0)
    lm, _ = graphed(target, fail=True)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3)]
    engine = SpeculativeEngine(lm, drafters, RandomPolicy(["lookup"], seed=0), EngineSettings(3, 20, SamplingParams()))
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        out = [t for r in engine.generate(PROMPTS[0]) for t in r.tokens]
    assert out == plain_greedy(target, PROMPTS[0], 20)
    assert lm.graphs.enabled is False
    assert [r.message for r in caplog.records].count(
        "CUDA graphs are off for this model: capturing its forward failed "
        "(operation not permitted when stream is capturing)") == 1


def test_forgetting_the_graphs_starts_a_fresh_capture_pool(monkeypatch):
    """CUDA's capture keeps one memory pool for all of a model's graphs; once they are
    forgotten (the cache grew) the pool is released, and capturing into it again fails in
    torch's allocator, so the next graphs get a capture (and pool) of their own. An injected
    capture is kept."""
    from specdraft.models import cuda_graphs

    made = []
    monkeypatch.setattr(cuda_graphs, "cuda_capture", lambda device: made.append(object()) or made[-1])
    graphs = GraphedForward(lambda *a: None, torch.device("cpu"))
    first = graphs.capture
    graphs.clear()
    assert len(made) == 2 and graphs.capture is made[1] and graphs.capture is not first
    injected = FakeCapture(None)
    kept = GraphedForward(lambda *a: None, torch.device("cpu"), injected)
    kept.clear()
    assert kept.capture is injected and len(made) == 2


def test_cudas_capture_keeps_the_cyclic_collector_out_of_a_capture(monkeypatch):
    """A dropped model's graphs are freed by the cyclic collector; one freed mid-capture
    ends that capture on a real GPU (tests/test_cuda.py shows it), so no collection may run
    inside one. CUDA's calls are stubbed here: what is checked is the collector's state."""
    import contextlib
    import gc

    from specdraft.models import cuda_graphs

    class Graph:
        def replay(self):
            pass

    for name, stub in (("graph_pool_handle", lambda: 0), ("Stream", lambda device: None),
                       ("device", lambda device: contextlib.nullcontext()), ("synchronize", lambda device: None),
                       ("CUDAGraph", Graph), ("graph", lambda graph, pool, stream: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, stub)
    capture = cuda_graphs.cuda_capture(torch.device("cuda", 0))
    seen = []
    capture(lambda: seen.append(gc.isenabled()) or (None, {}))
    assert seen == [False] and gc.isenabled()

    def failing():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        capture(failing)
    assert gc.isenabled()


def test_the_cache_goes_by_the_keyword_the_models_forward_takes():
    """transformers renamed forward's `past_key_values` to `cache` (the old name warns, and
    goes in 5.40, which the `transformers<6` pin allows); earlier 5.x releases take only the
    old one."""
    import warnings

    from specdraft.models.kv_cache import cache_keyword

    class Renamed(torch.nn.Module):
        def forward(self, input_ids=None, cache=None):
            pass

    class Earlier(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None):
            pass

    assert cache_keyword(Renamed()) == "cache" and cache_keyword(Earlier()) == "past_key_values"
    for static in (False, True):
        lm = CachedLM(tiny_llama(seed=0), static=static)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            lm.feed(torch.tensor([5, 9, 11]), keep=1)
            lm.feed_tree(torch.tensor([4, 8, 6]), [-1, 0, 0])


def test_auto_is_static_with_graphs_on_cuda_and_dynamic_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert core_choice("auto", True, cpu) == (False, False)
    assert core_choice("auto", True, cuda) == (True, True)
    assert core_choice("auto", False, cuda) == (True, False)
    assert core_choice("static", True, cpu) == (True, False)  # graphs are CUDA's
    assert core_choice("dynamic", True, cuda) == (False, False)


def test_a_profile_chooses_the_static_cache(pool_file):
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime

    text = pool_file.read_text().replace("max_new_tokens = 24",  # the drafter through transformers too
                                       'max_new_tokens = 24\nkv_cache = "static"\ndrafter_core = "transformers"')
    text = text.replace('dtype = "float64"', 'dtype = "float64"\ndevice = "cpu"')  # also where CUDA is there
    pool_file.write_text(text)
    runtime = build_runtime(load_profile(pool_file))
    small = next(d for d in runtime.drafters if d.name == "small")
    assert runtime.engine.target.kv.static and small.lm.kv.static
    assert runtime.engine.target.graphs is None  # CUDA graphs are CUDA's
    plain = build_runtime(load_profile(pool_file), runtime.target, plain=True)
    prompt = list(runtime.tokenizer.encode("hello there"))
    ours = [t for r in runtime.engine.generate(prompt) for t in r.tokens]
    assert ours == [t for r in plain.engine.generate(prompt) for t in r.tokens]


def test_models_with_sliding_window_layers_keep_the_dynamic_cache():
    """A sliding-window layer of transformers' static cache keeps a host-side length and
    rolls its buffers: a position reset would not roll it back. Such models decode over the
    dynamic cache (and without graphs), still exactly."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    model = MistralForCausalLM(config).to(torch.float64).eval()
    lm = CachedLM(model, static=True, graphs=True)
    assert not lm.kv.static and lm.graphs is None
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    torch.manual_seed(1)
    other = MistralForCausalLM(config).to(torch.float64).eval()  # rejected often: its cache rolls back
    drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("other", ctx, other)]
    policy = RandomPolicy(["lookup", "other"], {"draft_length": "fixed"}, seed=0)
    engine = SpeculativeEngine(lm, drafters, policy, EngineSettings(3, 30, SamplingParams()))
    for prompt in PROMPTS:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(model, prompt, 30)


def test_token_trees_replay_one_graph_per_tree_size_and_match_plain_greedy():
    """Tree rounds over a graphed static cache: each tree size is captured once (its mask an
    input buffer) and replayed, and the text is plain greedy decoding's."""
    from test_tree_round import scripted_branches

    target, small = tiny_llama(seed=0), tiny_llama(seed=1, layers=1)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    target_lm, capture = graphed(target)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), ModelDrafter("small", ctx, small),
                ModelDrafter("twin", ctx, target), LayersDrafter("half", ctx, target_lm, 2)]
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=1),
                               EngineSettings(3, 40, SamplingParams()))
    scripted_branches(engine, seed=6, most=2, deepest=2)
    for prompt in PROMPTS * 3:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 40)
    trees = [key for key in target_lm.graphs.graphs if key[3] is not None]
    assert trees and len(trees) <= 9  # one graph per tree size seen twice (sizes 1..9 rows)
    assert capture.replays > 2 * capture.captures
