"""The target's linear layers on oneDNN's packed weights (models/kernels/packed_linear.py): nn.Linear's
products up to float rounding at every decode width, the dense weights given back or kept,
the models and settings that do not pack, stock kernels for transformers' baselines, and
output that stays plain greedy decoding through a pool that runs the packed target."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, NgramDrafter
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels.packed_linear import (PackedLinear, pack_linears, packing_choice, packing_problem,
                                            stock_kernels)
from specdraft.models.kernels.quantize import quantize_linears
from tiny import VOCAB, plain_greedy, tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_nn_linear_at_every_decode_width(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(copy.deepcopy(linear))
    for width in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(1, width, 48)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(6, 48)  # 2-D input, and a non-contiguous view
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    view = torch.randn(6, 96)[:, ::2]
    torch.testing.assert_close(packed(view), linear(view), rtol=1e-5, atol=1e-5)


def test_the_dense_weight_comes_back_exactly_and_is_not_kept_unless_asked():
    linear = nn.Linear(16, 24)
    packed = PackedLinear(linear)
    assert packed.dense is None
    assert torch.equal(packed.weight, linear.weight.detach())
    kept = PackedLinear(linear, keep_dense=True)
    assert kept.weight is kept.dense


def test_pack_linears_replaces_float_linears_only_and_a_tied_head_reads_the_embedding():
    model = tiny_llama().float()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as small models are
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # by reference: no copy
    assert model.model.layers[0].mlp.down_proj.dense is None  # the others keep only the packed form
    quantized = tiny_llama().float()
    quantize_linears(quantized, 8)
    assert pack_linears(quantized) == 0  # int8 layers keep their kernels


def test_a_packed_model_gives_the_stock_logits():
    model = tiny_llama().float()
    stock = copy.deepcopy(model)
    pack_linears(model)
    tokens = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, stock(tokens).logits, rtol=1e-4, atol=1e-4)


def test_stock_kernels_run_nn_linear_on_the_kept_weights_and_need_them():
    model = tiny_llama().float()
    pack_linears(model, keep_dense=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(3, layer.in_features)
    with stock_kernels(model):
        assert torch.equal(layer(x), F.linear(x, layer.dense, layer.bias))
    assert not layer.stock
    bare = tiny_llama().float()
    pack_linears(bare)
    with pytest.raises(ValueError, match="keep_dense"):
        with stock_kernels(bare):
            pass


def test_which_models_pack(caplog):
    model = tiny_llama().float()
    assert packing_choice("auto", model) and packing_choice("onednn", model)
    assert not packing_choice("torch", model)
    assert "float64" in packing_problem(tiny_llama())  # the tests' float64 models keep torch's kernels
    assert "float16" in packing_problem(tiny_llama().half())
    with caplog.at_level("WARNING", logger="specdraft"):
        assert not packing_choice("onednn", tiny_llama())
    assert "keeps torch's linear kernels" in caplog.text
    pack_linears(model)
    assert not packing_choice("auto", model)  # already packed: once per model
    with pytest.raises(ValueError, match="linear_kernel"):
        packing_choice("mkl", model)


@pytest.mark.parametrize("k", [1, 4])
def test_speculation_over_a_packed_target_keeps_stock_greedy_output(k):
    target = tiny_llama(0, scale=4.0).float()
    stock = copy.deepcopy(target)
    pack_linears(target)
    params = SamplingParams(0.0)
    ctx = DraftContext(params, None, torch.device("cpu"), VOCAB)
    engine = SpeculativeEngine(CachedLM(target), [NgramDrafter("lookup", ctx)],
                               RandomPolicy(["lookup"], seed=0, draft_tokens=k),
                               EngineSettings(draft_tokens=k, max_new_tokens=40, sampling=params))
    for prompt in ([5, 9, 11, 5, 9], [7, 3, 3, 8, 20, 21, 7, 3]):
        got = [t for record in engine.generate(prompt) for t in record.tokens]
        assert got == plain_greedy(stock, prompt, 40)


def test_a_runtime_packs_a_float32_target_and_its_self_drafters_share_it(tiny_models, tmp_path):
    from specdraft.profile import load_profile
    from specdraft.models.loading import load_model
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_run import PromptRun

    pool = tmp_path / "pool.toml"
    text = (f'[target]\npath = "{tiny_models}/target"\ndtype = "float32"\n[decode]\ndraft_tokens = 4\n'
            f'max_new_tokens = 24\n[policy]\nname = "random"\n'
            f'[[drafters]]\nname = "lookup"\nkind = "ngram"\n'
            f'[[drafters]]\nname = "half"\nkind = "layers"\nlayers = 2\n'
            f'[[drafters]]\nname = "small"\nkind = "model"\npath = "{tiny_models}/drafter"\ndtype = "float32"\n')
    pool.write_text(text)
    profile = load_profile(pool).with_overrides(seed=0)
    stock = load_model(profile.target, str(pool), "target")
    runtime = build_runtime(profile, keep_dense=True)
    assert isinstance(runtime.target.model.lm_head, PackedLinear)
    run = PromptRun(runtime, "abcabc abc", False).run()
    ids = torch.tensor([run.prompt_ids])
    with torch.inference_mode():
        reference = stock.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        with stock_kernels(runtime.target.model):  # what the bench's transformers baselines run
            baseline = runtime.target.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert list(run.detokenizer.ids) == reference == baseline.tolist()
    assert sum(usage.drafted for usage in run.stats.usage.values()) > 0
    pool.write_text(text.replace("[decode]\n", '[decode]\nlinear_kernel = "torch"\n'))
    plain = build_runtime(load_profile(pool))
    assert not any(isinstance(m, PackedLinear) for m in plain.target.model.modules())
    pool.write_text(text.replace("[decode]\n", '[decode]\nlinear_kernel = "mkl"\n'))
    with pytest.raises(Exception, match="linear_kernel"):
        load_profile(pool)
