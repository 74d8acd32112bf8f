"""The `head` drafter kind and `specdraft train head`: lossless drafting from the target's
features under every policy, exact full-information scores, the draft-vocabulary mapping,
refusal on another target, and training that lowers the KL, resumes and survives Ctrl-C."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.decoding.engine import EngineSettings, SpeculativeEngine
from specdraft.decoding.sampling import SamplingParams, distributions
from specdraft.drafters import DraftContext, NgramDrafter
from specdraft.drafters.head import HeadDrafter
from specdraft.drafters.head_model import DraftHead, HeadConfig, HeadFileError, Readout, load_head, save_head
from specdraft.learning.policies import build_policy
from specdraft.models.cached_lm import CachedLM
from specdraft.training.features import extract_features
from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
from specdraft.training.loop import STATE, LoopSettings, train
from tiny import VOCAB, plain_greedy, random_head, tiny_llama

PROMPTS = [[5, 9, 11, 3, 7, 5, 9], [17], [1, 40, 41, 42, 40, 41, 42, 40]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=3)


def engine_for(target, head, policy_name, params=SamplingParams(), k=4, max_new=32, **options):
    ctx = DraftContext(params, None, torch.device("cpu"), VOCAB)
    drafters = [NgramDrafter("lookup", ctx, 1, 3), HeadDrafter("head", ctx, head, target)]
    options = ({"drafter": "head"} | options) if policy_name == "fixed" else options
    policy = build_policy(policy_name, options, [d.name for d in drafters], seed=0, draft_tokens=k, horizon=max_new)
    return SpeculativeEngine(CachedLM(target), drafters, policy, EngineSettings(k, max_new, params)), drafters


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("policy, options", [("fixed", {"draft_length": "fixed"}), ("fixed", {}), ("ucb", {}),
                                             ("normalhedge", {"update_every": 1, "evaluate": "all"}),
                                             ("normalhedge", {})])
def test_greedy_output_with_a_head_is_plain_greedy(target, prompt, policy, options):
    for vocab in (None, list(range(0, VOCAB, 2))):  # whole vocabulary, and half of it
        engine, drafters = engine_for(target, random_head(target, vocab), policy, **options)
        out = [t for r in engine.generate(prompt) for t in r.tokens]
        assert out == plain_greedy(target, prompt, 32)


def test_a_head_trained_on_the_targets_own_text_drafts_what_the_target_says():
    """Trained on the target's greedy continuations of a few prompts (self-distillation), a
    head drafts most of what the target then says for one of them: training and drafting
    pair features and tokens the same way."""
    target = tiny_llama(seed=0, layers=2, scale=6.0)  # sharp: the target's argmax is clear
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    tokens = np.array([p + plain_greedy(target, p, 45) for p in prompts], dtype=np.int32)
    head, _ = trained_head(target, tokens, steps=200, lr=1e-2)
    engine, _ = engine_for(target, head, "fixed", draft_length="fixed")
    records = list(engine.generate(prompts[0]))
    assert [t for r in records for t in r.tokens] == plain_greedy(target, prompts[0], 32)
    assert sum(r.accepted for r in records) > 0.5 * sum(r.drafted for r in records)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(soft_feedback=True),
                                    SamplingParams(0.9, top_k=20)])
def test_full_information_scores_equal_a_fresh_draft_at_each_position(target, params):
    """What the evaluator scores the head with at a committed position is the first-token
    alignment of a draft made from scratch there (trajectory_scores recomputes it)."""
    generator = torch.Generator().manual_seed(0)
    engine, drafters = engine_for(target, random_head(target, list(range(40))), "fixed", params=params,
                                  drafter="lookup", evaluate="all", update_every=1,
                                  reset="never")  # "prompt" would leave the prompt's last round unscored
    engine.generator = generator
    for drafter in drafters:
        drafter.ctx = DraftContext(params, generator, torch.device("cpu"), VOCAB)
    prompt = PROMPTS[2]
    gammas, context = [], list(prompt)
    for record in engine.generate(prompt):
        for _, g in record.evaluated or ():
            gammas.extend(g[1])
        context.extend(record.tokens)
    p = distributions(CachedLM(target).uncached_logits(context)[len(prompt) - 1 : -1], params)
    fresh = drafters[1].trajectory_scores(context, len(prompt), p, 3).alpha
    assert len(gammas) == len(fresh) > 10
    assert gammas == pytest.approx(fresh, abs=1e-9)


def test_the_draft_vocabulary_maps_back_to_target_ids_exactly(target):
    ids = torch.tensor([3, 7, 8, 20, 41, 63])
    readout = Readout(target, ids)
    features = torch.randn(5, target.config.hidden_size, dtype=torch.float64)
    small = readout.small(features)
    wide = readout.widen(small, VOCAB)
    full = target.lm_head(features).detach()
    # a smaller matmul may sum in another order (BLAS blocking): equal to rounding, and a
    # wrong id mapping would be off by the logits' own scale
    torch.testing.assert_close(wide[:, ids], full[:, ids], rtol=0, atol=1e-12)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(wide[:, outside]).all()
    q = distributions(wide, SamplingParams(1.0))
    assert torch.allclose(q.sum(-1), torch.ones(5, dtype=q.dtype)) and (q[:, outside] == 0).all()
    # every drafted token is a draft-vocabulary id
    engine, drafters = engine_for(target, random_head(target, ids.tolist()), "fixed", draft_length="fixed")
    for record in engine.generate(PROMPTS[0]):
        pass
    drafted = drafters[1].propose(PROMPTS[0] + [3, 9], 4)
    assert set(drafted.tokens.tolist()) <= set(ids.tolist())


def test_a_head_for_another_target_is_refused(target, tmp_path):
    save_head(tmp_path / "h", random_head(target))
    assert isinstance(load_head(tmp_path / "h", target), DraftHead)
    other = tiny_llama(seed=9, layers=3)  # same shapes, other weights
    with pytest.raises(HeadFileError, match="another model of the same shape"):
        load_head(tmp_path / "h", other)
    wider = tiny_llama(seed=0, layers=3, hidden=48)
    with pytest.raises(HeadFileError, match="hidden_size = 32"):
        load_head(tmp_path / "h", wider)
    with pytest.raises(HeadFileError, match="no such folder"):
        load_head(tmp_path / "missing", target)


def test_a_saved_head_loads_with_the_same_outputs(target, tmp_path):
    head = random_head(target, [1, 2, 5, 9]).double()
    save_head(tmp_path / "h", head, {"steps": 3})
    loaded = load_head(tmp_path / "h", target).double()
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    x = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(4).view(1, 4)
    assert torch.allclose(loaded(x, x, positions), head(x, x, positions))
    assert json.loads((tmp_path / "h" / "head.json").read_text())["trained"] == {"steps": 3}


def trained_head(target, tokens, steps, tmp=None, seed=0, lr=3e-3):
    import tempfile
    from pathlib import Path

    from rich.console import Console

    folder = Path(tmp or tempfile.mkdtemp())
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], folder / "features")
    torch.manual_seed(seed)
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    rows = np.arange(tokens.shape[0])
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, noise=0.0),
                              rows, torch.device("cpu"))
    before = objective.evaluate(rows)
    train(head, LoopSettings(steps=steps, lr=lr, warmup=5), objective.step, lambda *a: None, folder,
          Console(stderr=True, quiet=True))
    return head.eval(), (before, objective.evaluate(rows))


def test_a_few_training_steps_lower_the_kl():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, size=(8, 48)).astype(np.int32)
    _, (before, after) = trained_head(target, tokens, steps=40, lr=1e-2)
    assert after["kl"] < 0.7 * before["kl"]


def test_the_draft_vocabulary_is_the_most_frequent_tokens_plus_the_required_ones():
    tokens = np.array([[5, 5, 5, 6, 6, 7, 8]], dtype=np.int32)
    assert draft_vocabulary(tokens, 2, 10).tolist() == [5, 6]
    assert draft_vocabulary(tokens, 3, 10, always=(2,)).tolist() == [2, 5, 6]
    assert draft_vocabulary(tokens, 50, 10).tolist() == list(range(10))


def test_ctrl_c_saves_a_usable_head_and_the_next_run_resumes(tmp_path):
    from rich.console import Console

    head = torch.nn.Linear(2, 1)
    saved = []

    def step_loss(step):
        if step == 3 and not saved:
            raise KeyboardInterrupt
        return (head(torch.ones(1, 2)) ** 2).sum(), {"loss": 0.0}

    settings = LoopSettings(steps=6, lr=1e-2, warmup=1, identity={"data": "x"})
    console = Console(stderr=True, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        train(head, settings, step_loss, lambda step, m: saved.append(step), tmp_path, console)
    assert saved == [3] and (tmp_path / STATE).exists()
    weights = head.weight.detach().clone()
    result = train(head, settings, step_loss, lambda step, m: saved.append(step), tmp_path, console)
    assert result.resumed_from == 3 and result.step == 6 and saved[-1] == 6
    assert not torch.equal(weights, head.weight)
    other = LoopSettings(steps=6, lr=1e-2, warmup=1, identity={"data": "y"})  # other data: from scratch
    assert train(head, other, step_loss, lambda *a: None, tmp_path, console).resumed_from == 0


BASE = """
[target]
path = "{root}/target"
dtype = "float64"

[[drafters]]
name = "lookup"
kind = "ngram"
"""

HEAD_POOL = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 4
max_new_tokens = 20

[policy]
name = "{policy}"
{policy_extra}

[[drafters]]
name = "lookup"
kind = "ngram"

[[drafters]]
name = "head"
kind = "head"
path = "{head}"
{head_extra}
"""


def test_train_head_command_writes_a_head_that_a_profile_drafts_with(tiny_models, tmp_path):
    from test_cli import expected_text

    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": f"count to {i}", "text": " ".join(map(str, range(i)))})
                                for i in range(5, 40)) + "\n")
    out = tmp_path / "head"
    args = ["train", "head", "--pool", str(base), "--data", str(corpus), "--out", str(out), "--steps", "6",
            "--seq-len", "64", "--batch", "2", "--draft-vocab", "200", "--features", str(tmp_path / "f")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    config = json.loads((out / "head.json").read_text())
    assert config["trained"]["steps"] == 6 and "held_out_top1" in config["trained"]
    assert "features" in result.stderr  # says what it is doing
    again = runner.invoke(app, args)  # features cached, training finished: nothing to redo
    assert again.exit_code == 0 and "reusing" in again.stderr

    profile = tmp_path / "pool.toml"
    for policy, extra in (("fixed", 'drafter = "head"'), ("normalhedge", "")):
        profile.write_text(HEAD_POOL.format(root=tiny_models, head=out, policy=policy, policy_extra=extra,
                                            head_extra=""))
        result = runner.invoke(app, ["generate", "--pool", str(profile), "hello there"])
        assert result.exit_code == 0, result.stderr
        assert result.stdout == expected_text(tiny_models, "hello there", max_new=20) + "\n"


def test_a_missing_head_is_a_profile_error_unless_optional(tiny_models, tmp_path):
    runner = CliRunner()
    profile = tmp_path / "pool.toml"
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="normalhedge",
                                        policy_extra="", head_extra=""))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 2 and "drafters[1].path" in result.stderr and "no such folder" in result.stderr
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="normalhedge",
                                        policy_extra="", head_extra="optional = true"))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 0 and 'drafter "head" left out of the pool' in result.stderr
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=tmp_path / "nope", policy="fixed",
                                        policy_extra='drafter = "head"', head_extra="optional = true"))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hi"])
    assert result.exit_code == 2 and 'drafts with "head", which is not available' in result.stderr


def test_train_head_usage_errors_exit_2(tiny_models, tmp_path):
    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    tiny_text = tmp_path / "t.txt"
    tiny_text.write_text("hi")
    for extra, message in ((["--data", str(tmp_path / "none.txt")], "no such file"),
                           (["--data", str(tiny_text)], "fewer than 2 sequences"),
                           (["--data", str(tiny_text), "--lr", "0"], "--lr"),
                           (["--data", str(tiny_text), "--epochs", "-1"], "--epochs")):
        result = runner.invoke(app, ["train", "head", "--pool", str(base), "--out", str(tmp_path / "o"), *extra])
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr


def test_a_head_times_its_own_forward_for_traces(target):
    engine, drafters = engine_for(target, random_head(target), "fixed")
    seconds = drafters[1].forward_seconds((1, 5), repeats=2)
    assert set(seconds) == {1, 5} and all(s > 0 for s in seconds.values())
    assert drafters[1].head_cache.length == 0  # left reset
    out = [t for r in engine.generate(PROMPTS[0]) for t in r.tokens]
    assert out == plain_greedy(target, PROMPTS[0], 32)


def test_unrolled_training_scores_the_second_draft_step_on_the_heads_own_prediction(tmp_path):
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(4, 16)).astype(np.int32)
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], tmp_path / "f")
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, unroll=2, noise=0.0),
                              np.arange(4), torch.device("cpu"))
    loss, metrics = objective.step(0)
    assert set(metrics) == {"kl", "top1", "kl@2", "top1@2"}
    # depth 2 reads depth 1's predictions: its inputs depend on the head's weights twice
    loss.backward()
    assert head.fc.weight.grad is not None and torch.isfinite(loss)
    one, _ = objective.loss(*objective.batch(np.arange(4)), noise=False, unroll=1)
    two, m2 = objective.loss(*objective.batch(np.arange(4)), noise=False, unroll=2)
    assert float(two) != pytest.approx(float(one))


def test_handed_over_features_grow_past_the_buffer_and_can_be_rewritten(target):
    from specdraft.drafters.head import HeadCache

    cache = HeadCache(random_head(target), target, VOCAB)
    rows = torch.randn(300, target.config.hidden_size, dtype=torch.float64)
    cache.observe(0, rows[:200])
    cache.observe(200, rows[200:])  # past the initial 256 rows
    assert torch.equal(cache.features, rows)
    cache.observe(150, rows[:10])  # a position handed over again replaces what followed it
    assert cache.known == 160 and torch.equal(cache.features[150:], rows[:10])
    with pytest.raises(ValueError, match="before those at 160"):
        cache.observe(170, rows[:1])


def test_a_head_drafting_for_a_packed_target_is_packed_and_drafts_the_same():
    """A head follows its target onto oneDNN's packed kernels (layer and readout), with the
    same draft logits up to float rounding, and output stays plain greedy decoding."""
    from specdraft.models.packed_linear import PackedLinear, pack_linears

    target = tiny_llama(seed=0, layers=3).float()
    packed_target = tiny_llama(seed=0, layers=3).float()
    pack_linears(packed_target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    dense = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2))).float(), target)
    packed = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2))).float(), packed_target)
    assert not any(isinstance(m, PackedLinear) for m in dense.head_cache.head.modules())
    assert isinstance(packed.head_cache.head.fc, PackedLinear) and packed.head_cache.readout.packed is not None
    features = torch.randn(6, target.config.hidden_size)
    for drafter in (dense, packed):
        drafter.head_cache.observe(0, features)
    context = [5, 9, 11, 3, 7, 5, 9]
    torch.testing.assert_close(packed.head_cache.consume(context, 6, 5), dense.head_cache.consume(context, 6, 5),
                               rtol=1e-4, atol=1e-4)
    token = torch.tensor(4)
    torch.testing.assert_close(packed.head_cache.step(token), dense.head_cache.step(token), rtol=1e-4, atol=1e-4)
    for prompt in PROMPTS:
        engine, _ = engine_for(packed_target, random_head(target).float(), "fixed")
        assert [t for r in engine.generate(prompt) for t in r.tokens] == plain_greedy(target, prompt, 32)
