"""The decode core on a real GPU: the static KV cache with CUDA's own graph capture (the
other tests fake the capture on a CPU), chains and token trees, greedy and sampled, and the
command line with `device = "auto"` picking CUDA. Skipped where torch sees no CUDA device;
`SPECDRAFT_REQUIRE_CUDA=1` turns that skip into a failure (for runs on a lent GPU)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.core.sampling import SamplingParams
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.drafters import DraftContext, ModelDrafter, NgramDrafter, SuffixDrafter
from specdraft.drafters.head import HeadDrafter
from specdraft.drafters.layers import LayersDrafter
from specdraft.drafters.options import SuffixOptions
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.models import kv_cache
from specdraft.models.cached_lm import CachedLM
from test_sampling import SAMPLING_PROMPT, assert_follows_laws, pair_and_third_laws
from test_tree_round import scripted_branches
from tiny import VOCAB, plain_greedy, random_head, tiny_llama

if not torch.cuda.is_available():
    if os.environ.get("SPECDRAFT_REQUIRE_CUDA") == "1":
        raise RuntimeError("SPECDRAFT_REQUIRE_CUDA=1 but torch sees no CUDA device")
    pytest.skip("needs a CUDA device", allow_module_level=True)

CUDA = torch.device("cuda")
PROMPTS = [[5, 9, 11, 3, 7, 5, 9, 11, 3], [17], [40, 41, 42, 43, 40, 41]]


def on_cuda(model: torch.nn.Module) -> torch.nn.Module:
    return model.to(CUDA)


def graphed_target(model: torch.nn.Module) -> CachedLM:
    lm = CachedLM(model, static=True, graphs=True)
    assert lm.graphs is not None
    return lm


def greedy_pool(target: torch.nn.Module, target_lm: CachedLM, ctx: DraftContext) -> list:
    small = on_cuda(tiny_llama(seed=1, layers=1))
    return [NgramDrafter("lookup", ctx, 1, 3),
            SuffixDrafter("suffix", ctx, SuffixOptions()),
            ModelDrafter("small", ctx, small, lm=CachedLM(small, logits_size=VOCAB, static=True, graphs=True)),
            ModelDrafter("twin", ctx, target),  # the target itself: its chain is always accepted
            LayersDrafter("half", ctx, target_lm, 2),  # writes into the target's own static cache
            HeadDrafter("head", ctx, random_head(target).to(CUDA), target)]


@pytest.mark.parametrize("capacity", [None, 16])  # 16: the cache grows mid-prompt, graphs are captured again
def test_real_cuda_graphs_over_the_static_cache_match_plain_greedy_for_every_drafter(monkeypatch, capacity):
    if capacity:
        monkeypatch.setattr(kv_cache, "STATIC_CAPACITY", capacity)
    target = on_cuda(tiny_llama(seed=0))
    target_lm = graphed_target(target)
    ctx = DraftContext(SamplingParams(), None, CUDA, VOCAB)
    drafters = greedy_pool(target, target_lm, ctx)
    policy = RandomPolicy([d.name for d in drafters], {"draft_length": "fixed"}, seed=2)
    engine = SpeculativeEngine(target_lm, drafters, policy, EngineSettings(4, 40, SamplingParams()))
    for prompt in PROMPTS * 2:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 40)
    assert target_lm.graphs.enabled and target_lm.graphs.graphs, "the target's forwards were never captured"
    assert drafters[2].lm.graphs.enabled and drafters[2].lm.graphs.graphs


def test_a_capture_survives_the_collector_freeing_another_models_graphs():
    """A dropped model's graphs are freed by Python's cyclic collector; with it running at
    almost every allocation, the next models' captures still succeed (a graph freed
    mid-capture would end the capture and switch graphs off)."""
    import gc

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        model = on_cuda(tiny_llama(seed=0))
        tokens = torch.tensor([5, 9, 11, 3], device=CUDA)
        for _ in range(4):
            lm = graphed_target(model)
            lm.feed(tokens, keep=1)
            for _ in range(3):  # eager, capture, replay
                lm.feed(tokens[:2], keep=1)
                lm.crop(4)
            assert lm.graphs.enabled and lm.graphs.graphs
            del lm  # garbage in a cycle, holding its graphs
    finally:
        gc.set_threshold(*threshold)


def test_real_cuda_graphs_replay_one_graph_per_tree_size_and_trees_match_plain_greedy():
    target = on_cuda(tiny_llama(seed=0))
    target_lm = graphed_target(target)
    ctx = DraftContext(SamplingParams(), None, CUDA, VOCAB)
    drafters = greedy_pool(target, target_lm, ctx)
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=1),
                               EngineSettings(3, 40, SamplingParams()))
    scripted_branches(engine, seed=6, most=3, deepest=3)
    trees = Counter()
    for prompt in PROMPTS * 3:
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 40)
        trees.update(r.tree.tree_size for r in records if len(r.tree.branches) > 1)
    captured = [key for key in target_lm.graphs.graphs if key[3] is not None]
    assert target_lm.graphs.enabled and captured, "no token tree was replayed from a graph"
    assert len(trees) >= 3  # several tree sizes, each its own graph


def test_sampled_token_trees_on_cuda_follow_the_target():
    """Three tokens sampled at T = 1 with trees of two to three drafters every round, over a
    graphed static cache on the GPU, follow the target's exact joint law (computed on the CPU
    from the same float64 weights)."""
    params, vocab = SamplingParams(1.0), 6
    cpu_target = tiny_llama(seed=0, vocab=vocab, layers=2, scale=8.0)
    joint2, marginal3 = pair_and_third_laws(cpu_target, SAMPLING_PROMPT, params)
    target = on_cuda(cpu_target)
    target_lm = graphed_target(target)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    ctx = DraftContext(params, gen, CUDA, vocab)
    drafters = [ModelDrafter("small", ctx, on_cuda(tiny_llama(seed=5, vocab=vocab, layers=1, scale=8.0))),
                NgramDrafter("lookup", ctx, 1, 2),
                LayersDrafter("half", ctx, target_lm, 1),
                SuffixDrafter("suffix", ctx, SuffixOptions(min_prob=0.0))]
    engine = SpeculativeEngine(target_lm, drafters, RandomPolicy([d.name for d in drafters], seed=2),
                               EngineSettings(3, 3, params), gen)
    scripted_branches(engine, seed=4, most=3, deepest=3, least=2)
    assert_follows_laws(engine, SAMPLING_PROMPT, joint2, marginal3)
    assert target_lm.graphs.enabled and target_lm.graphs.graphs


def test_the_command_line_runs_on_cuda_with_graphs_and_loses_nothing(monkeypatch, pool_file, tmp_path):
    """`device = "auto"` puts the tiny pool on the GPU (static cache, graphs); bench's every
    output equals plain decoding's, trees and one chain alike."""
    built = []
    init = CachedLM.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append((self.device.type, self.graphs is not None))

    monkeypatch.setattr(CachedLM, "__init__", recording)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hello hello hello hello", "task": "copy"}\n{"prompt": "abc abc", "task": "open"}\n')
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "--pool", str(pool_file), "--data", str(data), "-n", "24",
                                      "--policies", "normalhedge,normalhedge(tree=false),fixed:lookup",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    samples = json.loads(out.read_text())["samples"]
    assert samples and all(not s["mismatch"] for s in samples)
    assert ("cuda", True) in built and all(device == "cuda" for device, _ in built)
