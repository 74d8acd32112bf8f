"""SD2 steering: zero steering leaves the drafter exactly as it was, the training offsets are
the paper's block offsets, a few steps lower the KL, output with a steered drafter stays
lossless, `train steer` writes what a `steered` drafter loads, and the steered drafter runs
in a pool under every policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare
import torch
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.core.sampling import SamplingParams
from specdraft.drafters import DraftContext, NgramDrafter
from specdraft.drafters.steered import SteeredDrafter
from specdraft.drafters.steering import SteeringHooks, gated_mlps, load_steering, new_steering, save_steering
from specdraft.learning.policies import POLICIES
from specdraft.learning.policies.simple import FixedPolicy, RandomPolicy
from specdraft.models.cached_lm import CachedLM
from specdraft.training.features import extract_features
from specdraft.training.steer import SteerObjective, SteerTrainingSettings, draw_offsets, source_positions
from tiny import VOCAB, plain_greedy, tiny_llama

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [17, 4]]


def randomized(steering, seed=0, scale=0.5):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in steering.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return steering


def test_zero_steering_leaves_the_drafters_logits_unchanged_exactly():
    target, drafter = tiny_llama(seed=0), tiny_llama(seed=1, layers=2)
    steering = new_steering(target, drafter).double()
    ids = torch.tensor([PROMPTS[0]])
    plain = drafter(ids).logits
    hooks = SteeringHooks(drafter)
    states = torch.randn(3, target.config.hidden_size, dtype=torch.float64)
    hooks.bias = steering(states)  # W_s starts at zero
    assert torch.equal(drafter(ids).logits, plain)
    hooks.bias = randomized(steering)(states)
    assert not torch.allclose(drafter(ids).logits, plain)  # the hooks do reach the drafter
    hooks.remove()
    assert torch.equal(drafter(ids).logits, plain)


def test_training_offsets_are_the_blocks_offsets():
    """The drafter predicting token t is steered from position t - d, d uniform in [2, K + 1]
    (the latest verified position is two before a block's first token, K + 1 before its last)."""
    k, length = 4, 40
    offsets = draw_offsets(64, length, k, np.random.default_rng(0))
    assert offsets.min() == 2 and offsets.max() == k + 1
    counts = np.bincount(offsets.reshape(-1))[2:]
    assert len(counts) == k and chisquare(counts).pvalue > 1e-3  # uniform over 2..K+1
    source, valid = source_positions(offsets)
    predicted = np.arange(length)[None, :] + 1  # index i predicts token i + 1
    want = predicted - offsets
    assert np.array_equal(valid.numpy(), want >= 0)  # no state before the sequence: left out
    assert np.array_equal(source.numpy()[want >= 0], want[want >= 0])
    assert np.array_equal(source.numpy()[want < 0], np.zeros((want < 0).sum()))
    assert bool(valid[:, k:].all())  # from index K on, every offset has a state
    fixed, fixed_valid = source_positions(np.full((1, 6), 2))  # evaluation at the first draft token
    assert fixed.tolist() == [[0, 0, 1, 2, 3, 4]] and fixed_valid.tolist() == [[False] + [True] * 5]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    target = tiny_llama(seed=0)
    rng = np.random.default_rng(0)
    tokens = np.repeat(rng.integers(3, VOCAB, size=(12, 8)), 4, axis=1).astype(np.int32)  # learnable repeats
    steering_layers = (1, 2, 2)
    layers = sorted({*steering_layers, target.config.num_hidden_layers})
    data = extract_features(target, tokens, layers, tmp_path_factory.mktemp("features"))
    return target, data, steering_layers


@pytest.mark.parametrize("steering_on", [True, False])
def test_a_few_training_steps_lower_the_kl(features, steering_on):
    target, data, layers = features
    drafter = tiny_llama(seed=1, layers=2).float().train()
    steering = new_steering(target, drafter, layers, steering=steering_on).float()
    settings = SteerTrainingSettings(batch_sequences=4, max_draft=3, steering=steering_on, bf16=False)
    objective = SteerObjective(drafter, steering, target.lm_head.weight.detach(), data, settings, np.arange(12),
                               torch.device("cpu"))
    before = objective.evaluate(np.arange(12))["kl"]
    params = [*drafter.parameters(), *(steering.parameters() if steering_on else [])]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    for step in range(25):
        loss, _ = objective.step(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = objective.evaluate(np.arange(12))["kl"]
    assert after < 0.8 * before
    if steering_on:
        assert steering.w_s.weight.abs().sum() > 0  # the steering learned too


@pytest.mark.parametrize("chunk", [64, 3])
def test_a_live_draft_is_what_training_steered(features, monkeypatch, chunk):
    """The drafter's cache and draft at decode time are the training forward with the
    matching offsets: every committed token steered from two positions back (the prompt
    included, in chunks or not, fed by a draft or by scoring's prefill), the block's j-th
    token from the latest verified state, j + 2 back."""
    import specdraft.drafters.steered as steered_module

    monkeypatch.setattr(steered_module, "CONTEXT_CHUNK", chunk)
    target, data, layers = features
    drafter_model = tiny_llama(seed=1, layers=2)
    steering = randomized(new_steering(target, drafter_model, layers).double())
    settings = SteerTrainingSettings(batch_sequences=1, max_draft=3, bf16=False)
    objective = SteerObjective(drafter_model, steering, target.lm_head.weight.detach(), data, settings,
                               np.arange(12), torch.device("cpu"))
    params = SamplingParams(1.0)
    prompt, k = [5, 9, 11, 3, 7, 5, 9, 30, 12, 8, 41], 3
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for prefill_first in (False, True):
        ctx = DraftContext(params, torch.Generator().manual_seed(4), torch.device("cpu"), VOCAB)
        drafter = SteeredDrafter("steered", ctx, drafter_model, steering, target)
        drafter.observe_features(0, {layer: hidden[layer][0, : len(prompt) - 1] for layer in set(layers)})
        if prefill_first:
            drafter.prepare_scoring(prompt)
        draft = drafter.propose(prompt, k)
        tokens = torch.tensor([prompt + draft.tokens.tolist()])
        with torch.no_grad():
            states = torch.stack([target(tokens, output_hidden_states=True).hidden_states[layer][0]
                                  for layer in layers], dim=1)[None]  # [1, T, 3, H]
        index = np.arange(tokens.shape[1])
        offsets = np.where(index < len(prompt), 2, index + 3 - len(prompt))[None]
        with torch.no_grad():
            logits, _ = objective.steered_logits(tokens, states, offsets)
        trained = torch.softmax(logits[0, len(prompt) - 1 : len(prompt) - 1 + k], dim=-1)
        torch.testing.assert_close(draft.probs, trained)


def steered_engine(target, steering, params, policy=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = DraftContext(params, gen, torch.device("cpu"), VOCAB)
    drafter_model = tiny_llama(seed=1, layers=2)
    steering = steering or randomized(new_steering(target, drafter_model).double())
    drafters = [NgramDrafter("lookup", ctx, 1, 3),
                SteeredDrafter("steered", ctx, drafter_model, steering, target)]
    policy = policy or FixedPolicy([d.name for d in drafters], {"drafter": "steered", "draft_length": "fixed"})
    return SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(3, 30, params), gen), drafters[1]


@pytest.mark.parametrize("policy", ["fixed", "random"])
def test_greedy_output_with_a_steered_drafter_is_plain_greedy(policy):
    target = tiny_llama(seed=0)
    chosen = None if policy == "fixed" else RandomPolicy(["lookup", "steered"], seed=3)
    engine, drafter = steered_engine(target, None, SamplingParams(), chosen)
    for prompt in PROMPTS:
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 30)
    assert drafter.latest is not None and drafter.latest.shape == (3, target.config.hidden_size)
    assert drafter.hooks.bias is None  # only set while it drafts or scores


def test_the_steering_follows_the_latest_verified_position():
    """Drafting after a verify uses the states the verify handed over for its last committed
    position: drafting differs from drafting with the previous round's states."""
    target = tiny_llama(seed=0)
    engine, drafter = steered_engine(target, None, SamplingParams())
    seen = []
    original = drafter.observe_features

    def record(position, hidden):
        original(position, hidden)
        seen.append((position + hidden[drafter.steering.config.layers[0]].shape[0] - 1, drafter.latest.clone()))

    drafter.observe_features = record
    records = list(engine.generate(PROMPTS[0]))
    committed = len(PROMPTS[0])
    for record_, (last_position, _) in zip(records, seen[1:]):
        committed += len(record_.tokens)
        assert last_position == committed - 2  # the verify has not seen the token it produced
    assert not torch.equal(seen[0][1], seen[-1][1])


def test_a_round_reads_the_steering_once_and_drafts_with_the_latest_states_biases():
    """The block's bias is the last committed token's row of the catch-up's biases (both come
    from the latest verified state), so a round projects the steering once, not twice."""
    target = tiny_llama(seed=0)
    engine, drafter = steered_engine(target, None, SamplingParams())
    calls, block_biases, checking = [], [], [True]
    steering_forward, hook = drafter.steering.forward, drafter.hooks.hook(0)

    def counted(states):
        calls.append(states.shape)
        return steering_forward(states)

    def record(module, inputs, output):  # the bias each drafted token's forward adds
        steered = hook(module, inputs, output)
        if checking[0] and drafter.hooks.bias is not None and drafter.hooks.bias.dim() == 2:
            block_biases.append((drafter.hooks.bias.clone(), drafter.block_bias()))
        return steered

    drafter.steering.forward = counted
    drafter.hooks.remove()
    drafter.hooks.handles = [mlp.gate_proj.register_forward_hook(record if index == 0 else drafter.hooks.hook(index))
                             for index, mlp in enumerate(gated_mlps(drafter.lm.model))]
    records = list(engine.generate(PROMPTS[0]))
    drafted_rounds = sum(1 for r in records if r.drafted)
    assert drafted_rounds > 3 and len(block_biases) >= drafted_rounds
    for used, fresh in block_biases:
        torch.testing.assert_close(used, fresh)
    checking[0] = False
    calls.clear()
    records = list(engine.generate(PROMPTS[0]))
    drafted_rounds = sum(1 for r in records if r.drafted)
    # the prompt's prefill (chunked) and then one projection per drafted round
    assert len(calls) <= drafted_rounds + 1


def test_sampled_output_with_a_steered_drafter_follows_the_target():
    from test_sampling import P_MIN, chi_square_p, exact_joint

    vocab, prompt = 6, [1, 4, 2]
    target = tiny_llama(seed=0, vocab=vocab, layers=2, scale=8.0)
    params = SamplingParams(1.0)
    gen = torch.Generator().manual_seed(1)
    ctx = DraftContext(params, gen, torch.device("cpu"), vocab)
    drafter_model = tiny_llama(seed=5, vocab=vocab, layers=1, scale=8.0)
    steering = randomized(new_steering(target, drafter_model).double(), scale=2.0)
    drafter = SteeredDrafter("steered", ctx, drafter_model, steering, target)
    policy = FixedPolicy(["steered"], {"drafter": "steered", "draft_length": "fixed"})
    engine = SpeculativeEngine(CachedLM(target), [drafter], policy, EngineSettings(3, 3, params), gen)
    pairs, n_draws = {}, 1500
    for _ in range(n_draws):
        out = tuple(t for r in engine.generate(prompt) for t in r.tokens)[:2]
        pairs[out] = pairs.get(out, 0) + 1
    joint = {}
    for seq, prob in exact_joint(target, prompt, params, 2).items():
        joint[seq] = joint.get(seq, 0.0) + prob
    from collections import Counter

    assert chi_square_p(Counter(pairs), joint, n_draws) > P_MIN


def test_steering_for_another_target_or_drafter_is_refused(tmp_path):
    from specdraft.drafters.steering import SteeringFileError

    target, drafter = tiny_llama(seed=0), tiny_llama(seed=1, layers=2)
    steering = randomized(new_steering(target, drafter).double())
    save_steering(tmp_path / "s", steering, drafter, {"steps": 1})
    loaded = load_steering(tmp_path / "s", target, tiny_llama(seed=1, layers=2))
    torch.testing.assert_close(loaded.w_s.weight.double(), steering.w_s.weight)
    with pytest.raises(SteeringFileError, match="another target"):
        load_steering(tmp_path / "s", tiny_llama(seed=7), tiny_llama(seed=1, layers=2))
    with pytest.raises(SteeringFileError, match="another drafter"):
        load_steering(tmp_path / "s", target, tiny_llama(seed=8, layers=2))


STEER_POOL = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 3
max_new_tokens = 16

[policy]
name = "{policy}"
{policy_extra}

[[drafters]]
name = "lookup"
kind = "ngram"

[[drafters]]
name = "small"
kind = "{kind}"
path = "{root}/drafter"
dtype = "float64"
{extra}
"""


def steer_inputs(tiny_models, tmp_path):
    """A pool whose `small` drafter is a plain model drafter, and a prompt/answer corpus."""
    base = tmp_path / "base.toml"
    base.write_text(STEER_POOL.format(root=tiny_models, policy="fixed", policy_extra='drafter = "small"',
                                      kind="model", extra=""))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": f"count to {i}", "text": " ".join(map(str, range(i)))})
                                for i in range(5, 30)) + "\n")
    return base, corpus


def test_train_steer_writes_what_a_steered_drafter_loads_and_every_policy_runs_it(tiny_models, tmp_path):
    from test_cli import expected_text

    runner = CliRunner()
    base, corpus = steer_inputs(tiny_models, tmp_path)
    out = tmp_path / "steer"
    args = ["train", "steer", "--pool", str(base), "--drafter", "small", "--data", str(corpus), "--out", str(out),
            "--steps", "4", "--seq-len", "48", "--layers", "1,2,3", "--features", str(tmp_path / "f")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    config = json.loads((out / "steer.json").read_text())
    assert config["trained"]["steps"] == 4 and config["layers"] == [1, 2, 3] and config["drafter_trained"]
    assert (out / "steer.safetensors").exists() and (out / "drafter.safetensors").exists()
    distilled = tmp_path / "distilled"
    result = runner.invoke(app, ["train", "steer", "--pool", str(base), "--drafter", "small", "--data", str(corpus),
                                 "--out", str(distilled), "--steps", "2", "--seq-len", "48", "--no-steering",
                                 "--layers", "1,2,3", "--features", str(tmp_path / "f")])
    assert result.exit_code == 0, result.stderr
    assert not (distilled / "steer.safetensors").exists() and not json.loads(
        (distilled / "steer.json").read_text())["steering"]

    profile = tmp_path / "pool.toml"
    want = expected_text(tiny_models, "hello there", max_new=16)
    for policy in sorted(POLICIES):
        extra = 'drafter = "small"' if policy == "fixed" else ""
        for folder in (out, distilled):
            profile.write_text(STEER_POOL.format(root=tiny_models, policy=policy, policy_extra=extra, kind="steered",
                                                 extra=f'steering = "{folder}"'))
            result = runner.invoke(app, ["generate", "--pool", str(profile), "hello there"])
            assert result.exit_code == 0, (policy, result.stderr)
            assert result.stdout == want + "\n", policy


def test_train_steer_and_the_steered_kind_refuse_bad_input(tiny_models, tmp_path):
    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(STEER_POOL.format(root=tiny_models, policy="fixed", policy_extra='drafter = "small"',
                                      kind="model", extra=""))
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    for extra, message in ((["--drafter", "lookup"], "steering needs a pretrained model drafter"),
                           (["--drafter", "nope"], "no such drafter"),
                           (["--drafter", "small", "--layers", "1,2"], "--layers"),
                           (["--drafter", "small", "--freeze-drafter", "--no-steering"], "nothing to train")):
        result = runner.invoke(app, ["train", "steer", "--pool", str(base), "--data", str(text), "--out",
                                     str(tmp_path / "o"), "--seq-len", "16", "--steps", "1", *extra])
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr
    profile = tmp_path / "pool.toml"
    profile.write_text(STEER_POOL.format(root=tiny_models, policy="fixed", policy_extra='drafter = "small"',
                                         kind="steered", extra=f'steering = "{tmp_path / "missing"}"'))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 2 and "drafters[1].steering" in result.stderr and "no such folder" in result.stderr


def test_a_steering_only_drafter_shares_the_pretrained_model_and_leaves_it_unsteered(tiny_models, tmp_path):
    """`--freeze-drafter` leaves the pretrained weights as they were, so a pool holding the
    `model` drafter and the steered one keeps one copy; the model drafter stays unsteered
    and output stays plain greedy."""
    from test_cli import expected_text

    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime

    from transformers import AutoModelForCausalLM

    target, drafter = (AutoModelForCausalLM.from_pretrained(tiny_models / name, dtype=torch.float64)
                       for name in ("target", "drafter"))
    folder = tmp_path / "frozen"
    save_steering(folder, randomized(new_steering(target, drafter)), None, {"steps": 1})
    profile = tmp_path / "pool.toml"
    profile.write_text(STEER_POOL.format(root=tiny_models, policy="random", policy_extra="", kind="model", extra="")
                       + f'\n[[drafters]]\nname = "steered"\nkind = "steered"\npath = "{tiny_models}/drafter"\n'
                       f'dtype = "float64"\nsteering = "{folder}"\n')
    runtime = build_runtime(load_profile(profile))
    small, steered = (next(d for d in runtime.drafters if d.name == name) for name in ("small", "steered"))
    assert steered.lm.model is small.lm.model
    model, ids = small.lm.model, torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        alone = model(ids).logits
        hidden = runtime.target.model(ids, output_hidden_states=True).hidden_states
        steered.observe_features(0, {layer: hidden[layer][0] for layer in steered.feature_layers})
        with steered.steering_on():
            assert not torch.allclose(model(ids).logits, alone)  # the hooks are on this very model
        steered.propose(PROMPTS[0], 3)
        assert torch.equal(model(ids).logits, alone)
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hello there"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected_text(tiny_models, "hello there", max_new=16) + "\n"


def test_with_native_bf16_a_float32_drafter_projects_the_steering_in_bf16(monkeypatch):
    """The round's projection reads all of W_s: where bf16 matmuls are native it runs on a
    bf16 copy (the loaded steering stays float32), and output stays plain greedy."""
    import specdraft.drafters.steered as steered_module

    monkeypatch.setattr(steered_module, "native_bf16", lambda device: True)
    target, drafter_model = tiny_llama(seed=0), tiny_llama(seed=1, layers=2).float()
    steering = randomized(new_steering(target, drafter_model), scale=0.1)
    gen = torch.Generator().manual_seed(0)
    ctx = DraftContext(SamplingParams(), gen, torch.device("cpu"), VOCAB)
    drafter = SteeredDrafter("steered", ctx, drafter_model, steering, target)
    assert drafter.steering.w_s.weight.dtype == torch.bfloat16 and steering.w_s.weight.dtype == torch.float32
    states = torch.randn(5, 3, target.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(drafter.steering(states).float(), steering(states), rtol=0.05, atol=0.02)
    policy = FixedPolicy(["steered"], {"drafter": "steered", "draft_length": "fixed"})
    engine = SpeculativeEngine(CachedLM(target), [drafter], policy, EngineSettings(3, 30, SamplingParams()), gen)
    for prompt in PROMPTS:
        assert [t for r in engine.generate(prompt) for t in r.tokens] == plain_greedy(target, prompt, 30)
    assert SteeredDrafter("plain", ctx, tiny_llama(seed=1, layers=2), steering, target).steering is steering
