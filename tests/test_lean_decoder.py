"""The lean drafter forward (models/lean/decoder.py): the same logits as transformers' own
forward over every feed a draft makes, weights shared rather than copied, the models it
refuses, and output that stays plain greedy decoding when a pool's drafter runs it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, ModelDrafter
from specdraft.learning.policies.simple import RandomPolicy
from specdraft.models.cached_lm import CachedLM
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.lean.support import lean_choice, lean_problem
from specdraft.models.kernels.quantize import quantize_linears
from tiny import VOCAB, plain_greedy, tiny_llama


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2's shape: biases on q, k and v, grouped key-value heads."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():  # random biases, so that fusing them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


def _reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_every_feed_of_a_draft_gives_transformers_logits(make):
    model = make()
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _reference(model, tokens)
    lm = CachedLM(model, lean=True)
    assert lm.lean is not None
    # A prompt, single tokens, a rollback of two rejected drafts, a block after it, all rows.
    torch.testing.assert_close(lm.feed(torch.tensor(tokens[:20])), expected[19:20])
    for i in range(20, 26):
        torch.testing.assert_close(lm.feed(torch.tensor(tokens[i : i + 1])), expected[i : i + 1])
    lm.feed(torch.tensor([5, 6]))  # drafts the target rejects
    lm.crop(26)
    torch.testing.assert_close(lm.feed(torch.tensor(tokens[26:31]), keep=3), expected[28:31])
    torch.testing.assert_close(lm.feed(torch.tensor(tokens[31:40]), keep=0), expected[31:40])
    assert lm.length == 40
    lm.reset()  # a new prompt starts from an empty buffer
    torch.testing.assert_close(lm.feed(torch.tensor(tokens[:5])), expected[4:5])


def test_the_buffer_grows_past_its_first_capacity(monkeypatch):
    monkeypatch.setattr("specdraft.models.lean.decoder.INITIAL_CAPACITY", 8)
    model = tiny_llama()
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    lm = CachedLM(model, lean=True)
    lm.feed(torch.tensor(tokens[:6]))
    for i in range(6, 29):
        lm.feed(torch.tensor(tokens[i : i + 1]))
    torch.testing.assert_close(lm.feed(torch.tensor(tokens[29:30])), _reference(model, tokens)[29:30])
    assert lm.lean.capacity == 32


def test_fused_projections_share_the_weights_and_leave_transformers_forward_unchanged():
    model = tiny_qwen2()
    tokens = list(range(3, 20))
    before = _reference(model, tokens)
    lean = LeanDecoder(model)
    attn = model.model.layers[0].self_attn
    fused = lean.layers[0].qkv
    assert attn.q_proj.weight.data_ptr() == fused.weight.data_ptr()  # a slice, not a copy
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(_reference(model, tokens), before)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafters_run_lean_with_their_own_kernels(bits):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    quantize_linears(model, bits)
    tokens = list(range(3, 23))
    expected = _reference(model, tokens)
    lm = CachedLM(model, lean=True)
    lm.feed(torch.tensor(tokens[:10]))
    got = torch.cat([lm.feed(torch.tensor(tokens[i : i + 1])) for i in range(10, 20)])
    # Both run the same bfloat16 kernels; only the order of float32 sums around them differs.
    torch.testing.assert_close(got, expected[10:20], atol=2e-2, rtol=0)
    assert torch.equal(got.argmax(-1), expected[10:20].argmax(-1))


def test_models_it_cannot_run_say_why():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    assert "GPT2LMHeadModel is not one of" in lean_problem(gpt2)
    hooked = tiny_llama()
    hooked.model.layers[0].mlp.act_fn.register_forward_hook(lambda module, args, out: out + 1)
    assert "forward hooks" in lean_problem(hooked)
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanDecoder(gpt2)


@pytest.mark.parametrize("lean_core", ["kernels", "torch"])
def test_sliding_window_layers_attend_their_last_positions_only(lean_core, monkeypatch):
    """A sliding window (Qwen2's use_sliding_window here, Gemma 3's local layers) keeps each
    row's last `sliding_window` positions, on the kernels and in torch, as transformers does."""
    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=5, max_window_layers=1)).eval()
    assert lean_problem(sliding) is None
    tokens = list(range(3, 23))  # four times the window
    lm = CachedLM(sliding, lean=True)
    if lean_core == "torch":
        monkeypatch.setattr(lm.lean, "invariant", False)
    got = torch.cat([lm.feed(torch.tensor(tokens[:6]), keep=0)] + [lm.feed(torch.tensor([t])) for t in tokens[6:]])
    torch.testing.assert_close(got, _reference(sliding, tokens), rtol=1e-4, atol=1e-4)


def test_the_lean_forward_hands_over_transformers_hidden_states():
    model = tiny_llama()
    tokens = torch.tensor([3, 4, 9, 12])
    logits, hidden = CachedLM(model, lean=True).feed_with_hidden(tokens, 0, (0, 2))
    reference = model(tokens[None], output_hidden_states=True)
    for layer in (0, 2):
        torch.testing.assert_close(hidden[layer], reference.hidden_states[layer][0])
    torch.testing.assert_close(logits, reference.logits[0])


def test_auto_is_lean_on_a_cpu_only_and_transformers_turns_it_off(caplog):
    model = tiny_llama()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert lean_choice("auto", model, cpu) and lean_choice("lean", model, cpu)
    assert not lean_choice("auto", model, cuda) and not lean_choice("transformers", model, cpu)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with caplog.at_level("WARNING", logger="specdraft"):
        assert not lean_choice("lean", gpt2, cpu)
    assert "runs through transformers" in caplog.text


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_lean_drafter_keeps_output_plain_greedy(k):
    target, draft_model = tiny_llama(0, scale=4.0), tiny_llama(1, layers=2, scale=4.0)
    params = SamplingParams(0.0)
    ctx = DraftContext(params, None, torch.device("cpu"), VOCAB)
    drafter = ModelDrafter("small", ctx, draft_model, lm=CachedLM(draft_model, logits_size=VOCAB, lean=True))
    engine = SpeculativeEngine(CachedLM(target), [drafter], RandomPolicy(["small"], seed=0, draft_tokens=k),
                               EngineSettings(draft_tokens=k, max_new_tokens=40, sampling=params))
    for prompt in ([5, 9, 11], [7, 3, 3, 8, 20, 21]):
        got = [t for record in engine.generate(prompt) for t in record.tokens]
        assert got == plain_greedy(target, prompt, 40)


def test_a_pools_model_drafters_run_lean_unless_hooked_or_told_not_to(tmp_path):
    from specdraft.profile import load_profile
    from specdraft.drafters.base import PoolContext

    ctx = DraftContext(SamplingParams(0.0), None, torch.device("cpu"), VOCAB)
    model = tiny_llama()
    pool = PoolContext(ctx, None, None, "pool.toml", 0)
    assert pool.cached_lm(model).lean is not None
    assert pool.cached_lm(model, hooked=True).lean is None  # steered drafters: their hooks must run
    off = PoolContext(ctx, None, None, "pool.toml", 0, drafter_core="transformers")
    assert off.cached_lm(model).lean is None
    (tmp_path / "t").mkdir()
    profile = tmp_path / "p.toml"
    profile.write_text('[target]\npath = "t"\n[decode]\ndrafter_core = "transformers"\n'
                       '[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
    assert load_profile(profile).decode.drafter_core == "transformers"
    profile.write_text(profile.read_text().replace('"transformers"', '"fast"'))
    with pytest.raises(Exception, match="drafter_core"):
        load_profile(profile)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_rotary_angles_come_from_the_models_own_module_at_every_position(scaling):
    # the lean forward reads cos and sin from a table of positions (grown past its first
    # size here); a rope that rescales with the length runs the module every time
    model = tiny_llama()
    if scaling is not None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        model.config.rope_parameters = {**model.config.rope_parameters, **scaling}
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
        assert model.model.rotary_emb.rope_type == scaling["rope_type"]
    lean = LeanDecoder(model)
    x = torch.zeros(1, 1, model.config.hidden_size)
    for positions in ([0], [3, 4, 5], [511, 512], [1500, 7, 2000]):
        at = torch.tensor(positions)
        cos, sin = lean._rotary(x, at)
        want_cos, want_sin = model.model.rotary_emb(x, at.view(1, -1))
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert (not lean._rope) == (scaling is not None and scaling["rope_type"] == "dynamic")  # (no table kept)


@pytest.mark.parametrize("lean_core", ["kernels", "torch"])
def test_gemma3_layers_give_transformers_logits(lean_core, monkeypatch):
    """Gemma 3's layers (post-norms, GeGLU, QK norm, 1 + w norms, the scaled embedding, local
    layers with a sliding window and their own rotary base, the attention scale from
    query_pre_attn_scalar) on the lean forward, against transformers' own forward."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              query_pre_attn_scalar=24, max_position_embeddings=128)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their zero start, so 1 + w matters
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    assert lean_problem(model) is None
    tokens = list(range(3, 23))  # four times the window
    lm = CachedLM(model, lean=True)
    assert [layer.window for layer in lm.lean.layers] == [5, 5, 0] and len(lm.lean.rope_kinds) == 2
    if lean_core == "torch":
        monkeypatch.setattr(lm.lean, "invariant", False)
    got = torch.cat([lm.feed(torch.tensor(tokens[:6]), keep=0)] + [lm.feed(torch.tensor([t])) for t in tokens[6:]])
    torch.testing.assert_close(got, _reference(model, tokens), rtol=1e-4, atol=1e-4)
