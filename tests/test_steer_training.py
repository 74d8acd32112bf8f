"""What `train steer` learns from: only the answers of chat exchanges (a drafter never drafts
a prompt), and with `--train-layers N` only the steering and the drafter's last N decoder
layers, the drafter it writes staying lossless in a pool."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.drafters.steering import new_steering
from specdraft.training.corpus import Document
from specdraft.training.features import FeatureSet, token_stream
from specdraft.training.steer import SteerObjective, SteerTrainingSettings, predicted_mask
from test_steer import STEER_POOL, randomized, steer_inputs
from tiny import VOCAB, byte_tokenizer, tiny_llama


def test_an_exchanges_prompt_is_not_learned_its_answer_and_plain_text_are():
    tokenizer = byte_tokenizer()
    docs = [Document(exchange=("add 2", "sum = 2")), Document("plain")]
    tokens, answer = token_stream(docs, tokenizer, chat=True, separator=7)
    asked = tokenizer.apply_chat_template([{"role": "user", "content": "add 2"}], tokenize=True,
                                          add_generation_prompt=True)
    asked = list(asked["input_ids"] if hasattr(asked, "keys") else asked)
    assert tokens[: len(asked)] == asked and not any(answer[: len(asked)])
    assert tokenizer.decode(tokens[len(asked) : len(asked) + 7]) == "sum = 2"
    assert all(answer[len(asked):])  # the answer, its end of turn and the plain document
    assert tokens[-1] == 7 and len(tokens) == len(answer)
    _, raw = token_stream(docs, tokenizer, chat=False, separator=7)
    assert all(raw)  # outside the chat template there is no prompt to tell apart


def test_the_steering_loss_counts_only_positions_that_predict_a_learned_token():
    target, drafter = tiny_llama(seed=0), tiny_llama(seed=1, layers=2).float()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, size=(2, 10)).astype(np.int32)
    hidden = target.config.hidden_size
    features = {layer: rng.standard_normal((2, 10, hidden)).astype(np.float16) for layer in (1, 2, 3)}
    mask = np.ones((2, 10), dtype=bool)
    mask[:, :4] = False  # a prompt: tokens 0-3 are not learned, so neither are predictions 0-2
    data = FeatureSet(None, tokens, features, mask)
    learned = predicted_mask(data, np.arange(2))
    assert learned[:, :3].sum() == 0 and bool(learned[:, 3:].all())
    steering = randomized(new_steering(target, drafter, (1, 2, 3)), scale=0.1)
    objective = SteerObjective(drafter, steering, target.lm_head.weight.detach().float(), data,
                               SteerTrainingSettings(batch_sequences=2, max_draft=3, bf16=False), np.arange(2),
                               torch.device("cpu"))
    tokens_t, states, final, _ = objective.batch(np.arange(2))

    def kl(positions):
        only = torch.zeros(2, 10, dtype=torch.bool)
        only[:, positions] = True
        return objective.loss(tokens_t, states, final, only, offset=2)[0].item()

    each = [kl([i]) for i in range(1, 10)]
    assert kl(list(range(4, 8))) == pytest.approx(np.mean(each[3:7]), rel=1e-5)
    assert objective.loss(tokens_t, states, final, learned, offset=2)[0].item() == pytest.approx(
        np.mean(each[2:]), rel=1e-5)  # positions 3-9: position 0 has no state two back


def _train(tiny_models, tmp_path, *extra):
    base, corpus = steer_inputs(tiny_models, tmp_path)
    out = tmp_path / "steer"
    result = CliRunner().invoke(app, ["train", "steer", "--pool", str(base), "--drafter", "small", "--data",
                                      str(corpus), "--out", str(out), "--steps", "3", "--seq-len", "48",
                                      "--layers", "1,2,3", "--features", str(tmp_path / "f"), *extra])
    return result, out


def test_train_layers_trains_only_the_last_layers_and_stays_lossless(tiny_models, tmp_path):
    from test_cli import expected_text

    result, out = _train(tiny_models, tmp_path, "--train-layers", "1")
    assert result.exit_code == 0, result.stderr
    trained = load_file(str(out / "drafter.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "drafter", dtype=torch.float64)
    pretrained, last = model.state_dict(), model.config.num_hidden_layers - 1
    changed = {name for name, value in trained.items()
               if not torch.equal(value.to(pretrained[name].dtype), pretrained[name])}
    assert changed and all(name.startswith(f"model.layers.{last}.") for name in changed), changed
    assert json.loads((out / "steer.json").read_text())["trained"]["train_layers"] == 1

    profile = tmp_path / "pool.toml"
    profile.write_text(STEER_POOL.format(root=tiny_models, policy="fixed", policy_extra='drafter = "small"',
                                         kind="steered", extra=f'steering = "{out}"'))
    result = CliRunner().invoke(app, ["generate", "--pool", str(profile), "hello there"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected_text(tiny_models, "hello there", max_new=16) + "\n"


def test_train_layers_refuses_more_layers_than_the_drafter_has_or_a_frozen_drafter(tiny_models, tmp_path):
    for extra, message in ((["--train-layers", "99"], "decoder layers"),
                           (["--train-layers", "1", "--freeze-drafter"], "choose one"),
                           (["--train-layers", "0"], "at least 1")):
        result, _ = _train(tiny_models, tmp_path, *extra)
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr, (extra, result.stderr)


def test_train_steer_checks_its_numbers_and_folders_before_loading(tiny_models, tmp_path, monkeypatch):
    import specdraft.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "notes.txt").write_text("mine")
    a_head = tmp_path / "a-head"  # another command's folder: a draft head
    a_head.mkdir()
    (a_head / "head.json").write_text("{}")
    (a_head / "head.safetensors").write_text("")
    for extra, message in ((["--steer-lr-factor", "nan"], "--steer-lr-factor"),
                           (["--steer-lr-factor", "inf"], "--steer-lr-factor"),
                           (["--steer-lr-factor", "0"], "--steer-lr-factor"),
                           (["--lr", "inf"], "--lr"), (["--epochs", "nan"], "--epochs"),
                           (["--minutes", "-1"], "--minutes"),
                           (["--max-tokens", "10"], "--max-tokens 10"),
                           (["--out", str(papers)], "is not a trained steering's folder"),
                           (["--out", str(a_head)], "is not a trained steering's folder"),
                           (["--features", str(papers)], "is not a features cache"),
                           (["--out", "/proc/specdraft-test-steer"], "cannot write in /proc")):
        result, _ = _train(tiny_models, tmp_path, *extra)
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (extra, result.stderr)
    assert [p.name for p in papers.iterdir()] == ["notes.txt"]


def test_a_gguf_drafter_is_trained_on_its_dequantized_weights(tmp_path):
    """A .gguf drafter loads onto the file's block codes by default, which have no gradients
    (train steer crashed with "element 0 of tensors does not require grad"): it trains on its
    weights dequantized, and a large training state is announced before it is written."""
    from gguf_models import write_model

    target = write_model(tmp_path / "t.gguf", hidden=64, ffn=128, layers=4, tied=False, seed=0)
    drafter = write_model(tmp_path / "d.gguf", hidden=64, ffn=128, layers=2, tied=False, seed=1)
    pool = tmp_path / "pool.toml"
    pool.write_text(f'[target]\npath = "{target}"\n[[drafters]]\nname = "small"\nkind = "model"\npath = "{drafter}"\n')
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    from specdraft.training import loop

    original = loop.LARGE_STATE
    loop.LARGE_STATE = 1  # any state is "large" here: the announcement must come
    try:
        result = CliRunner().invoke(app, ["train", "steer", "--pool", str(pool), "--drafter", "small", "--data",
                                          str(corpus), "--out", str(tmp_path / "steer"), "--steps", "2",
                                          "--seq-len", "32", "--features", str(tmp_path / "f")])
    finally:
        loop.LARGE_STATE = original
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "steer" / "steer.json").exists()
    assert "the training state kept in" in result.stderr + result.stdout
