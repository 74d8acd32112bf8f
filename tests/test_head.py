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
from specdraft.training.features import RowBatches, extract_features
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
    # whole vocabulary, half of it, and a head that also reads the target's lower layers
    for vocab, lower in ((None, ()), (list(range(0, VOCAB, 2)), ()), (None, (1, 2))):
        engine, drafters = engine_for(target, random_head(target, vocab, lower_layers=lower), policy, **options)
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


@pytest.mark.parametrize("params, lower", [(SamplingParams(), ()), (SamplingParams(soft_feedback=True), ()),
                                           (SamplingParams(0.9, top_k=20), ()), (SamplingParams(), (1,)),
                                           (SamplingParams(0.9, top_k=20), (1, 2))])
def test_full_information_scores_equal_a_fresh_draft_at_each_position(target, params, lower):
    """What the evaluator scores the head with at a committed position is the first-token
    alignment of a draft made from scratch there (trajectory_scores recomputes it), also
    for a head that reads lower target layers (handed over with the verify)."""
    generator = torch.Generator().manual_seed(0)
    engine, drafters = engine_for(target, random_head(target, list(range(40)), lower_layers=lower), "fixed",
                                  params=params,
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


def trained_head(target, tokens, steps, tmp=None, seed=0, lr=3e-3, bf16=False):
    import tempfile
    from pathlib import Path

    from rich.console import Console

    folder = Path(tmp or tempfile.mkdtemp())
    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], folder / "features")
    torch.manual_seed(seed)
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    rows = np.arange(tokens.shape[0])
    objective = HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=4, noise=0.0, bf16=bf16),
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


def test_bf16_autocast_training_computes_the_same_loss_and_lowers_the_kl():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(8, 48)).astype(np.int32)
    objective = _objective(target, tokens, None, unroll=2)
    batch = objective.batch(np.arange(4))
    exact, _ = objective.loss(*batch, noise=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = objective.loss(*batch, noise=False)
    assert rounded.dtype == torch.float32  # the loss itself stays float32
    assert float(rounded) == pytest.approx(float(exact), rel=0.05) and float(rounded) != float(exact)
    # a training step autocasts exactly when the settings say so
    steps = {}
    for bf16 in (False, True):
        objective.settings.bf16 = bf16
        objective.batches = RowBatches(np.arange(4), 4, 0)
        steps[bf16] = float(objective.step(0)[0])
    assert steps[False] == pytest.approx(float(exact), rel=1e-5)
    assert steps[True] != pytest.approx(float(exact), rel=1e-5)
    _, (before, after) = trained_head(target, tokens, steps=40, lr=1e-2, bf16=True)
    assert after["kl"] < 0.7 * before["kl"]


def test_the_unrolled_loss_over_ragged_masks_is_the_dense_weighted_one():
    """The loss reads out only the pairs that count; it must equal weighing every pair."""
    import torch.nn.functional as F

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(4).integers(3, VOCAB, size=(3, 16)).astype(np.int32)
    mask = np.random.default_rng(5).random((3, 16)) < 0.6  # a different mask in every row
    objective = _objective(target, tokens, mask, unroll=3)
    tokens_t, features, learned = objective.batch(np.arange(3))
    loss, metrics, counts = objective.weighed_loss(tokens_t, features, learned, noise=False)

    head, readout = objective.head, objective.readout
    inputs = head.fused(features[:, :-1])
    embeddings = objective.embed(tokens_t[:, 1:]).float()
    goal = features[:, 1:, -head.config.hidden_size:]
    log_p = F.log_softmax(readout.small(goal).float(), dim=-1)
    weight = torch.cat([learned[:, 2:], learned[:, -1:]], dim=1).float()
    positions = torch.arange(15).expand(3, -1)
    dense = torch.zeros(())
    for depth, suffix in enumerate(("", "@2", "@3"), start=1):
        predicted = head(embeddings, inputs, positions)
        log_q = F.log_softmax(readout.small(predicted).float(), dim=-1)
        count = weight.sum().clamp_min(1.0)
        kl = ((log_p.exp() * (log_p - log_q)).sum(-1) * weight).sum() / count
        regression = (F.smooth_l1_loss(predicted, goal, reduction="none").mean(-1) * weight).sum() / count
        top1 = ((log_q.argmax(-1) == log_p.argmax(-1)).float() * weight).sum() / count
        dense = dense + (kl + regression) / 3
        assert metrics["kl" + suffix] == pytest.approx(float(kl), rel=1e-5)
        assert metrics["top1" + suffix] == pytest.approx(float(top1), rel=1e-6)
        assert counts[suffix] == float(weight.sum())
        inputs, embeddings, goal, log_p = predicted[:, :-1], embeddings[:, 1:], goal[:, 1:], log_p[:, 1:]
        positions, weight = positions[:, 1:], weight[:, 1:]
    assert float(loss) == pytest.approx(float(dense), rel=1e-5)


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
            "--seq-len", "64", "--batch", "2", "--draft-vocab", "200", "--features", str(tmp_path / "f"), "--fp32"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    config = json.loads((out / "head.json").read_text())
    assert config["trained"]["steps"] == 6 and "held_out_top1" in config["trained"]
    assert config["trained"]["bf16"] is False  # --fp32 ...
    assert "features" in result.stderr  # says what it is doing
    again = runner.invoke(app, args)  # features cached, training finished: nothing to redo
    assert again.exit_code == 0 and "reusing" in again.stderr
    bf16_args = [*args[:-1], "--bf16"]
    bf16_args[bf16_args.index("--out") + 1] = str(tmp_path / "head-bf16")
    bf16 = runner.invoke(app, bf16_args)
    assert bf16.exit_code == 0, bf16.stderr
    assert json.loads((tmp_path / "head-bf16" / "head.json").read_text())["trained"]["bf16"] is True  # ... --bf16

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
                           (["--data", str(tiny_text), "--epochs", "-1"], "--epochs"),
                           (["--data", str(tiny_text), "--unroll", "0"], "--unroll: 1 to 4"),
                           (["--data", str(tiny_text), "--unroll", "5"], "--unroll: 1 to 4")):
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


@pytest.mark.parametrize("packed_target", [False, True])
def test_the_lean_head_forward_drafts_what_transformers_forward_does(packed_target):
    """On a CPU a head's layer runs the lean forward over its own KV buffer (packed where the
    target is); its logits match transformers' one-layer forward with a DynamicCache, through
    catch-up feeds, drafted steps and rollbacks, with fused lower layers too."""
    from specdraft.models.packed_linear import pack_linears

    target = tiny_llama(seed=0, layers=3).float()
    if packed_target:
        pack_linears(target)
    ctx = DraftContext(SamplingParams(), None, torch.device("cpu"), VOCAB)
    head = random_head(target, list(range(0, VOCAB, 2)), lower_layers=(1,)).float()
    slow = HeadDrafter("head", ctx, random_head(target, list(range(0, VOCAB, 2)), lower_layers=(1,)).float(), target,
                       core="transformers")
    lean = HeadDrafter("head", ctx, head, target)
    assert slow.head_cache.lean is None and lean.head_cache.lean is not None
    features = torch.randn(12, 2 * target.config.hidden_size)
    context = [5, 9, 11, 3, 7, 5, 9, 2, 8, 4, 6, 1, 3]
    for drafter in (slow, lean):
        drafter.head_cache.observe(0, features)

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    caches = slow.head_cache, lean.head_cache
    close(*(c.consume(context, 6, 5) for c in caches))
    for token in (4, 10, 2):
        close(*(c.step(torch.tensor(token)) for c in caches))
    for cache in caches:  # the drafts are rejected: back to the committed pairs, then more of them
        cache.crop(6)
    close(*(c.consume(context, 11, 5) for c in caches))
    close(*(c.step(torch.tensor(7)) for c in caches))
    for cache in caches:  # a new prompt
        cache.reset()
        cache.observe(0, features.flip(0))
    close(*(c.consume(context[::-1], 9, 8) for c in caches))


def _objective(target, tokens, mask, unroll=1, tmp=None):
    import tempfile
    from pathlib import Path

    layer = target.config.num_hidden_layers
    data = extract_features(target, tokens, [layer], Path(tmp or tempfile.mkdtemp()) / "f")
    data.answer_mask = mask
    torch.manual_seed(0)
    head = new_head(target, draft_vocabulary(tokens, VOCAB, VOCAB))
    with torch.no_grad():  # away from the identity start, so every pair's loss differs
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rows = np.arange(tokens.shape[0])
    return HeadObjective(head, target, data, layer, HeadTrainingSettings(batch_sequences=len(rows), unroll=unroll,
                                                                         noise=0.0), rows, torch.device("cpu"))


def test_the_head_loss_counts_only_pairs_whose_predicted_token_is_learned():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(1).integers(3, VOCAB, size=(2, 12)).astype(np.int32)
    mask = np.ones((2, 12), dtype=bool)
    mask[:, :5] = False  # a chat prompt: tokens 0-4 are never drafted
    objective = _objective(target, tokens, mask)
    tokens_t, features, learned = objective.batch(np.arange(2))
    assert not learned[:, :5].any() and learned[:, 5:].all()

    def loss(positions):  # pairs whose predicted token (pair t predicts token t + 2) is learned
        only = torch.zeros(2, 12, dtype=torch.bool)
        only[:, [p + 2 for p in positions]] = True
        return objective.loss(tokens_t, features, only, noise=False)[0].item()

    each = [loss([t]) for t in range(10)]  # pairs 0..9 predict tokens 2..11
    assert len(set(round(e, 6) for e in each)) > 5  # the pairs' losses differ, so the means below can tell
    masked, _, counts = objective.weighed_loss(tokens_t, features, learned, noise=False)
    # pairs 3..9 predict learned tokens 5..11; pair 10 (the last) counts as token 11 does
    last = objective.loss(tokens_t, features, torch.ones(2, 12, dtype=torch.bool), noise=False)[0].item() * 11 \
        - sum(each)
    assert masked.item() == pytest.approx((sum(each[3:]) + last) / 8, rel=1e-4)
    assert counts[""] == 2 * 8


def test_held_out_metrics_are_means_over_learned_tokens_not_over_batches():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(2).integers(3, VOCAB, size=(3, 12)).astype(np.int32)
    mask = np.ones((3, 12), dtype=bool)
    mask[2, :11] = False  # the third sequence has a single learned token
    objective = _objective(target, tokens, mask)
    whole = objective.evaluate(np.arange(3))
    objective.settings.batch_sequences = 1  # three batches of very different sizes
    split = objective.evaluate(np.arange(3))
    assert split["kl"] == pytest.approx(whole["kl"], rel=1e-4)
    assert split["top1@2"] == pytest.approx(whole["top1@2"], rel=1e-4)


def test_unrolling_deeper_trains_each_later_draft_step_on_the_heads_own_predictions():
    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    tokens = np.random.default_rng(3).integers(3, VOCAB, size=(2, 16)).astype(np.int32)
    objective = _objective(target, tokens, None, unroll=4)
    loss, metrics = objective.step(0)
    assert set(metrics) == {f"{name}{depth}" for name in ("kl", "top1") for depth in ("", "@2", "@3", "@4")}
    counts = objective.weighed_loss(*objective.batch(np.arange(2)), noise=False)[2]
    assert counts == {"": 2 * 15, "@2": 2 * 14, "@3": 2 * 13, "@4": 2 * 12}  # one pair fewer per depth
    three, _ = objective.loss(*objective.batch(np.arange(2)), noise=False, unroll=3)
    four, _ = objective.loss(*objective.batch(np.arange(2)), noise=False, unroll=4)
    assert float(three) != pytest.approx(float(four))
    loss.backward()
    assert torch.isfinite(loss) and head_has_gradients(objective.head)


def head_has_gradients(head):
    """Every weight the head drafts with got a gradient (its unused 1-row token table aside)."""
    return all(p.grad is not None for name, p in head.named_parameters() if not name.startswith("body.embed_tokens"))


def test_a_head_reading_lower_layers_starts_as_the_final_feature_head_does(target):
    """`fuse` starts as 'take the final feature': before training, reading more layers
    changes nothing, so training starts from the recipe that reads the final feature only."""
    from specdraft.training.head import new_head

    ids = draft_vocabulary(np.arange(VOCAB), VOCAB, VOCAB)
    torch.manual_seed(0)
    plain = new_head(target, ids).double()
    torch.manual_seed(0)
    fused = new_head(target, ids, (1, 2)).double()
    assert fused.config.layers_read == [1, 2, 3] and plain.config.layers_read == [3]
    ids_t = torch.tensor([PROMPTS[0]])
    states = target(ids_t, output_hidden_states=True).hidden_states
    side_by_side = torch.cat([states[layer] for layer in (1, 2, 3)], dim=-1)
    positions = torch.arange(ids_t.shape[1]).view(1, -1)
    embeddings = target.get_input_embeddings()(ids_t)
    torch.testing.assert_close(fused(embeddings, fused.fused(side_by_side), positions),
                               plain(embeddings, plain.fused(states[3]), positions))


def test_a_head_reading_lower_layers_saves_and_loads_and_a_format_1_head_still_loads(target, tmp_path):
    head = random_head(target, [1, 2, 5, 9], lower_layers=(2,)).double()
    save_head(tmp_path / "h", head)
    loaded = load_head(tmp_path / "h", target).double()
    assert loaded.config.layers_read == [2, 3] and loaded.fuse is not None
    x = torch.randn(1, 4, 2 * target.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded.fused(x), head.fused(x))
    old = random_head(target, [1, 2, 5, 9])  # written before heads named the layers they read
    save_head(tmp_path / "old", old)
    config = json.loads((tmp_path / "old" / "head.json").read_text())
    del config["feature_layers"]
    config["format"] = 1
    (tmp_path / "old" / "head.json").write_text(json.dumps(config))
    assert load_head(tmp_path / "old", target).config.layers_read == [3]
    config["format"] = 9
    (tmp_path / "old" / "head.json").write_text(json.dumps(config))
    with pytest.raises(HeadFileError, match="format 9"):
        load_head(tmp_path / "old", target)


def test_train_head_fuse_layers_trains_a_head_that_reads_them_and_drafts_losslessly(tiny_models, tmp_path):
    from test_cli import expected_text

    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(str(i % 37) for i in range(600)))
    out = tmp_path / "head"
    result = runner.invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus), "--out", str(out),
                                 "--steps", "4", "--seq-len", "64", "--batch", "2", "--unroll", "3",
                                 "--fuse-layers", "1", "--features", str(tmp_path / "f")])
    assert result.exit_code == 0, result.stderr
    layers = json.loads((out / "head.json").read_text())["feature_layers"]
    assert layers[0] == 1 and len(layers) == 2
    profile = tmp_path / "pool.toml"
    profile.write_text(HEAD_POOL.format(root=tiny_models, head=out, policy="fixed", policy_extra='drafter = "head"',
                                        head_extra=""))
    result = runner.invoke(app, ["generate", "--pool", str(profile), "hello there"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected_text(tiny_models, "hello there", max_new=20) + "\n"
    for bad in ("0", "a,b", "99"):
        result = runner.invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus), "--out",
                                     str(tmp_path / "o"), "--fuse-layers", bad, "--features", str(tmp_path / "f")])
        assert result.exit_code == 2 and "--fuse-layers" in result.stderr, (bad, result.stderr)


def test_a_features_folder_with_more_layers_serves_without_a_target_pass_but_not_other_data(target, tmp_path):
    from specdraft.training.features import finished

    tokens = np.random.default_rng(4).integers(3, VOCAB, size=(3, 10)).astype(np.int32)
    folder = tmp_path / "f"
    full = extract_features(target, tokens, [1, 3], folder)
    assert finished(folder, tokens, [3]) and finished(folder, tokens, [1, 3]) and not finished(folder, tokens, [2])
    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        fewer = extract_features(target, tokens, [3], folder)
    finally:
        hook.remove()
    assert calls == [] and set(fewer.features) == {3}
    assert np.array_equal(fewer.features[3], full.features[3])
    other = tokens[::-1].copy()  # same shape, other data: never served from this folder
    assert not finished(folder, other, [3])
    again = extract_features(target, other, [3], folder)
    fresh = extract_features(target, other, [3], tmp_path / "g")
    assert np.array_equal(again.features[3], fresh.features[3])


@pytest.mark.parametrize("damage", ["done", "meta", "array"])
def test_a_damaged_features_cache_starts_over_instead_of_failing(target, tmp_path, damage):
    """A cache left by a kill or a full disk (a truncated done.json or meta.json, a missing
    array) used to make every later `train head` exit 1 until the folder was deleted."""
    from specdraft.training.features import finished

    tokens = np.random.default_rng(5).integers(3, VOCAB, size=(3, 10)).astype(np.int32)
    fresh = extract_features(target, tokens, [2], tmp_path / "fresh")
    folder = tmp_path / "f"
    extract_features(target, tokens, [2], folder)
    if damage == "array":
        (folder / "features-2.npy").unlink()
    else:
        path = folder / f"{damage}.json"
        path.write_text(path.read_text()[:5])
    assert not finished(folder, tokens, [2])
    again = extract_features(target, tokens, [2], folder)
    assert np.array_equal(again.features[2], fresh.features[2]) and finished(folder, tokens, [2])


def test_the_feature_pass_runs_packed_and_leaves_the_target_as_it_was(tmp_path):
    """The feature pass runs the target's linears packed (a CPU build with oneDNN) and keeps
    no logits but the last: its features are the dense forward's up to float rounding, and
    the target's own nn.Linear modules are back afterwards (training reads them densely)."""
    from specdraft.models.packed_linear import PackedLinear, packed_while

    target = tiny_llama(seed=0, layers=2, scale=6.0).float()
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(3, 16)).astype(np.int32)
    layers = [1, target.config.num_hidden_layers]
    with packed_while(target) as packed:
        assert packed == torch.backends.mkldnn.is_available()
        assert any(isinstance(m, PackedLinear) for m in target.modules()) == packed
    data = extract_features(target, tokens, layers, tmp_path / "f")
    assert [m for m in target.modules() if type(m) is torch.nn.Linear] == linears
    assert not any(isinstance(m, PackedLinear) for m in target.modules())
    with torch.inference_mode():
        dense = target(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True).hidden_states
    for layer in layers:
        torch.testing.assert_close(torch.from_numpy(np.asarray(data.features[layer], dtype=np.float32)),
                                   dense[layer].half().float(), rtol=2e-3, atol=2e-3)


def _no_model_loads(monkeypatch):
    """Every option below must be refused before a model loads."""
    import specdraft.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def test_train_head_refuses_folders_it_did_not_write_before_loading(tiny_models, tmp_path, monkeypatch):
    _no_model_loads(monkeypatch)
    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text " * 200)
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "notes.txt").write_text("mine")
    foreign_meta = tmp_path / "other-tool"
    foreign_meta.mkdir()
    (foreign_meta / "meta.json").write_text('{"author": "someone else"}')
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for extra, message in ((["--out", str(papers)], "is not a draft head's folder"),
                           (["--out", str(tmp_path / "h"), "--features", str(papers)], "is not a features cache"),
                           (["--out", str(tmp_path / "h"), "--features", str(foreign_meta)], "meta.json is not"),
                           (["--out", str(tmp_path / "h"), "--features", str(a_file)], "is a file"),
                           (["--out", str(a_file)], "is a file"),
                           (["--out", str(tmp_path / "h"), "--features", str(tmp_path / "h")], "the same folder"),
                           (["--out", "/proc/specdraft-test-head"], "cannot write in /proc"),
                           (["--out", str(tmp_path / "h"), "--features", "/proc/specdraft-test-f"],
                            "cannot write in /proc")):
        result = runner.invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus), *extra])
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (extra, result.stderr)
    assert sorted(p.name for p in papers.iterdir()) == ["notes.txt"]  # nothing written into them
    assert (foreign_meta / "meta.json").read_text() == '{"author": "someone else"}'
    assert not (tmp_path / "h").exists()


def test_train_head_numbers_are_finite_and_in_range_before_loading(tiny_models, tmp_path, monkeypatch):
    _no_model_loads(monkeypatch)
    runner = CliRunner()
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text " * 200)
    for extra, message in ((["--epochs", "nan"], "--epochs"), (["--epochs", "inf"], "--epochs"),
                           (["--epochs", "1e300"], "--epochs"), (["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"),
                           (["--lr", "-inf"], "--lr"), (["--seq-len", "4"], "--seq-len"), (["--batch", "0"], "--batch"),
                           (["--steps", "0"], "--steps"), (["--draft-vocab", "1"], "--draft-vocab"),
                           # the tokens --max-tokens keeps, not the whole stream's count
                           (["--max-tokens", "1", "--seq-len", "64"], "--max-tokens 1: makes fewer than 2 sequences")):
        result = runner.invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus),
                                     "--out", str(tmp_path / "h"), *extra])
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (extra, result.stderr)


def test_a_diverging_run_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path):
    from rich.console import Console

    from specdraft.training.loop import TrainingDiverged

    console = Console(stderr=True, quiet=True)
    head = torch.nn.Linear(2, 1)
    saved = []

    def save(step, metrics):
        assert all(torch.isfinite(p).all() for p in head.parameters())
        saved.append(step)

    def nan_at_step_4(step):
        loss = (head(torch.ones(1, 2)) ** 2).sum()
        return (loss * float("nan") if step == 4 else loss), {}

    settings = LoopSettings(steps=8, lr=1e-2, warmup=1, checkpoint_seconds=0.0, identity={"data": "x"})
    with pytest.raises(TrainingDiverged, match="the loss became nan at step 5 .*keeps the checkpoint of step 4") as err:
        train(head, settings, nan_at_step_4, save, tmp_path, console)
    assert err.value.exit_code == 1 and saved == [1, 2, 3, 4]
    assert torch.load(tmp_path / STATE, weights_only=False)["step"] == 4

    # --lr inf: the first update makes the weights nan; the final save is refused
    other = torch.nn.Linear(2, 1)
    saved.clear()
    inf_lr = LoopSettings(steps=1, lr=float("inf"), warmup=1, identity={"data": "y"})
    with pytest.raises(TrainingDiverged, match="nothing was saved"):
        train(other, inf_lr, lambda step: ((other(torch.ones(1, 2)) ** 2).sum(), {}), save, tmp_path / "o", console)
    assert saved == [] and not (tmp_path / "o" / STATE).exists()


def test_a_head_with_non_finite_weights_is_refused_when_loaded(target, tmp_path):
    from safetensors.torch import load_file, save_file

    save_head(tmp_path / "h", random_head(target))
    weights = tmp_path / "h" / "head.safetensors"
    state = load_file(str(weights))
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name][0] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(HeadFileError, match=f"{name} holds nan or infinite values"):
        load_head(tmp_path / "h", target)


def test_sigterm_saves_the_head_as_ctrl_c_does_and_exits_143(tiny_models, tmp_path, monkeypatch):
    import os
    import signal

    from specdraft.training.head import HeadObjective as Objective

    original = Objective.step

    def step(self, at):
        if at == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, at)

    monkeypatch.setattr(Objective, "step", step)
    # Without a handler of the command's, SIGTERM would end the test run: record it instead.
    received = []

    def record(signum, frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, record)
    try:
        base = tmp_path / "base.toml"
        base.write_text(BASE.format(root=tiny_models))
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("\n".join(json.dumps({"prompt": f"count to {i}", "text": " ".join(map(str, range(i)))})
                                    for i in range(5, 30)) + "\n")
        out = tmp_path / "head"
        result = CliRunner().invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus), "--out",
                                          str(out), "--steps", "6", "--seq-len", "64", "--batch", "2",
                                          "--draft-vocab", "200", "--features", str(tmp_path / "f"), "--fp32"])
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [] and result.exit_code == 143, result.stderr
    assert "terminated (SIGTERM) at step 2/6" in result.stderr
    assert json.loads((out / "head.json").read_text())["trained"]["steps"] == 2
    assert torch.load(out / STATE, weights_only=False)["step"] == 2
    assert restored is record  # the command's handler is gone with the command
