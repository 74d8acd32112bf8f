"""Weight-only int8/int4 drafters on CPU: the layers compute what their quantized weights
say, a quantized copy of the target stays a strong drafter, greedy output stays exact, and
profiles choose the quantization (bitsandbytes names still need CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specdraft.profile import load_profile
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter
from specdraft.errors import ProfileError
from specdraft.learning.policies.simple import FixedPolicy
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels.quantize import Int4Linear, Int8Linear, quantize_linears
from specdraft.runtime import build_runtime
from tiny import VOCAB, plain_greedy, tiny_llama


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_a_quantized_linear_is_close_to_the_float_layer(kind):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    x = torch.randn(2, 5, 64)
    layer = kind(linear)
    got, want = layer(x), linear(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    # int8 per-row: ~0.5% error; int4 per 32 columns: ~8%
    assert relative_error(got, want) < (0.02 if kind is Int8Linear else 0.15)


def test_int8_layer_computes_exactly_its_dequantized_weights():
    torch.manual_seed(1)
    linear = nn.Linear(32, 16, bias=False)
    layer = Int8Linear(linear)
    x = torch.randn(3, 32).bfloat16().float()  # representable in bf16: the kernel's input is exact
    want = x @ layer.dequantized().t()
    assert relative_error(layer(x), want) < 1e-2  # bf16 output rounding only
    assert layer.weight_int8.dtype == torch.int8 and int(layer.weight_int8.abs().max()) == 127


def test_quantize_replaces_every_linear_and_unties_the_head():
    model = tiny_llama(seed=0)
    count = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_linears(copy.deepcopy(model), 8) == count
    tied = tiny_llama(seed=0)
    tied.config.tie_word_embeddings = True
    quantized = copy.deepcopy(tied)
    quantize_linears(quantized, 8)
    assert isinstance(quantized.lm_head, Int8Linear) and not quantized.config.tie_word_embeddings
    assert isinstance(quantized.get_input_embeddings(), nn.Embedding)  # a lookup stays float


def test_int4_keeps_layers_its_kernel_cannot_take():
    model = tiny_llama(seed=0, vocab=VOCAB + 3)  # 67 output rows: not a multiple of 16
    quantize_linears(model, 4)
    assert isinstance(model.lm_head, nn.Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_twin_drafts_well_and_greedy_output_stays_exact(bits):
    target = tiny_llama(seed=0)
    twin = copy.deepcopy(target)
    quantize_linears(twin, bits)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    drafters = [ModelDrafter("twin", ctx, twin)]
    policy = FixedPolicy(["twin"], {"drafter": "twin", "draft_length": "fixed"})
    engine = SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(4, 40, SamplingParams()))
    for prompt in ([5, 9, 11, 3, 7], [17]):
        records = list(engine.generate(prompt))
        assert [t for r in records for t in r.tokens] == plain_greedy(target, prompt, 40)
        drafted = sum(r.drafted for r in records)
        accepted = sum(r.accepted for r in records)
        assert accepted / drafted > (0.7 if bits == 8 else 0.4), (accepted, drafted)


PROFILE = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 3
max_new_tokens = 12

[policy]
name = "fixed"
drafter = "small"

[[drafters]]
name = "small"
kind = "model"
path = "{root}/drafter"
dtype = "float32"
quantization = "{quantization}"
"""


def test_a_profile_quantizes_a_model_drafter_on_cpu(tiny_models, tmp_path):
    file = tmp_path / "pool.toml"
    file.write_text(PROFILE.format(root=tiny_models, quantization="int8"))
    runtime = build_runtime(load_profile(file))
    drafter = next(d for d in runtime.drafters if d.name == "small")
    assert any(isinstance(m, Int8Linear) for m in drafter.lm.model.modules())


def test_bitsandbytes_quantization_on_cpu_names_the_cpu_choices(tiny_models, tmp_path):
    file = tmp_path / "pool.toml"
    file.write_text(PROFILE.format(root=tiny_models, quantization="8bit").replace('dtype = "float32"',
                                                                                   'dtype = "float32"\ndevice = "cpu"'))
    with pytest.raises(ProfileError, match="int8 and int4 run on CPU"):
        build_runtime(load_profile(file))
