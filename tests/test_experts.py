"""A mixture-of-experts model (Qwen3-MoE, GGUF architecture qwen3moe) on its file's own codes:
the file's stacked expert tensors become one matrix per expert, the lean forward runs the
router and the chosen experts in C, and what it computes is transformers' model of the same
weights. Each row's experts and sums are its own, so a verify row equals the one-token step
bit for bit (lossless greedy speculation); the whole-layer C table and the layer-by-layer
path give the same numbers; a float model's experts (transformers' 3D parameters) run lean
as views. (llama.cpp's logits on the same files: test_llama_cpp_oracle.py.)"""

from __future__ import annotations

import pytest
import torch
from gguf_models import write_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from specdraft.models.cached_lm import CachedLM
from specdraft.models.gguf.file import GGUFFile
from specdraft.models.gguf.mapping import placements, resident_bytes
from specdraft.models.gguf_loading import load_gguf_mapped
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.experts import Experts
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.native_layers import experts_table, run_experts
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.lean.mixture import Mixture

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")

PROMPT = [72, 101, 108, 108, 111, 32, 116, 104, 101, 32, 109, 111]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))


def moe_file(folder, type_name: str = "Q8_0", experts=(8, 2), **shape):
    return write_model(folder / f"moe-{type_name}.gguf", "qwen3moe", type_name, hidden=256, ffn=256, layers=2,
                       heads=4, kv_heads=2, tied=False, experts=experts, **shape)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F32"])
def test_the_file_s_experts_are_one_matrix_each_on_the_kernels(tmp_path, type_name):
    path = moe_file(tmp_path, type_name)
    _, model = load_gguf_mapped(path, "p.toml", "target")
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.experts, Experts) and mlp.experts.num_experts == 8
    products = [part for m in [*mlp.experts.gate_up, *mlp.experts.down] for part in getattr(m, "parts", [m])]
    assert len(products) == 3 * 8 and all(isinstance(m, BlockLinear) for m in products)
    assert mlp.gate.weight.shape == (8, 256) and model.config.num_experts_per_tok == 2
    assert model.config.norm_topk_prob and model.config.moe_intermediate_size == 256
    # what the memory check counts holds every expert's matrices, not one expert's
    gguf = GGUFFile(path)
    one_expert = sum(p.tensor.nbytes for p in placements(gguf) if p.expert) // 8
    assert resident_bytes(placements(gguf), tied=False) > 8 * one_expert


def test_the_lean_forward_is_transformers_model_of_the_same_weights(tmp_path):
    """The mapped model's own forward (transformers' Qwen3-MoE code over specdraft's expert
    modules) and the lean forward agree to float rounding at every position."""
    _, model = load_gguf_mapped(moe_file(tmp_path, "F32"), "p.toml", "target")
    with torch.no_grad():
        reference = model(torch.tensor([PROMPT])).logits[0]
    lean = CachedLM(model, lean=True)
    assert lean.lean is not None
    rows = torch.cat([lean.feed(torch.tensor(PROMPT[:5]), keep=0)] +
                     [lean.feed(torch.tensor([t])) for t in PROMPT[5:]])
    torch.testing.assert_close(rows, reference, rtol=1e-4, atol=1e-4)
    assert (rows.argmax(-1) == reference.argmax(-1)).all()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_a_verify_row_equals_the_one_token_step_bit_for_bit(tmp_path, type_name):
    _, model = load_gguf_mapped(moe_file(tmp_path, type_name), "p.toml", "target")
    one, block = CachedLM(model, lean=True), CachedLM(model, lean=True)
    steps = torch.cat([one.feed(torch.tensor(PROMPT[:4]), keep=1)] +
                      [one.feed(torch.tensor([t])) for t in PROMPT[4:]])
    block.feed(torch.tensor(PROMPT[:3]), keep=1)
    wide = block.feed(torch.tensor(PROMPT[3:]), keep=0)  # 9 rows: up to 18 expert choices in one call
    assert torch.equal(wide, steps)


def test_the_c_table_and_the_layer_by_layer_path_agree_bit_for_bit(tmp_path):
    _, model = load_gguf_mapped(moe_file(tmp_path, "Q4_K"), "p.toml", "target")
    whole = LeanDecoder(model)
    assert whole._native_table() is not None
    by_layer = LeanDecoder(model)
    by_layer.whole_layers_in_c = False
    ids = torch.tensor(PROMPT)
    a, _ = whole.forward(ids, 0, 0)
    b, _ = by_layer.forward(ids, 0, 0)
    assert torch.equal(a, b)


def test_the_kernels_route_each_row_as_transformers_does(tmp_path):
    """Scores, top-k by probability, renormalized weights, the weighted sum: the C mixture
    equals the torch one to float rounding, with and without renormalizing."""
    _, model = load_gguf_mapped(moe_file(tmp_path, "Q8_0", experts=(6, 3)), "p.toml", "target")
    mlp = model.model.layers[0].mlp
    h = torch.randn(7, 256, generator=torch.Generator().manual_seed(0))
    for normalize in (True, False):
        mixture = Mixture.of(mlp, "silu")
        mixture.normalize = normalize
        table = experts_table(mixture)
        assert table is not None
        torch.testing.assert_close(run_experts(table, h, "silu"), mixture.forward(h), rtol=1e-4, atol=1e-5)


def test_a_table_the_kernels_cannot_run_is_refused_in_one_line(tmp_path):
    _, model = load_gguf_mapped(moe_file(tmp_path, "Q8_0"), "p.toml", "target")
    mixture = Mixture.of(model.model.layers[0].mlp, "silu")
    mixture.used = 9  # more experts than there are
    with pytest.raises(ValueError, match="expert_mlp: a size"):
        run_experts(experts_table(mixture), torch.randn(2, 256), "silu")
    with pytest.raises(ValueError, match="expert_mlp: h has shape"):
        run_experts(experts_table(Mixture.of(model.model.layers[0].mlp, "silu")), torch.randn(2, 128), "silu")


def test_a_float_mixture_runs_lean_on_views_of_its_parameters():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
            layer.mlp.experts.down_proj.normal_(0, 0.1)
        ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35]])
        reference = model(ids).logits[0]
    lean = CachedLM(model, lean=True)
    assert lean.lean is not None
    experts = lean.lean.layers[0].experts.experts
    assert experts.gate_up[1].weight.data_ptr() == model.model.layers[0].mlp.experts.gate_up_proj[1].data_ptr()
    torch.testing.assert_close(lean.feed(ids[0], keep=0), reference, rtol=1e-4, atol=1e-4)
