"""`specdraft train head`: writes a head a profile drafts with (also one reading lower
layers), refuses bad numbers and folders it did not write before a model loads, and on
SIGTERM saves the head as Ctrl-C does."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from heads import BASE, HEAD_POOL
from specdraft.cli import app
from specdraft.training.loop import STATE


def _profile_and_corpus(tiny_models, tmp_path, text: str):
    """The tiny models' training profile and a plain-text corpus, written under tmp_path."""
    base = tmp_path / "base.toml"
    base.write_text(BASE.format(root=tiny_models))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    return base, corpus


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


def test_train_head_fuse_layers_trains_a_head_that_reads_them_and_drafts_losslessly(tiny_models, tmp_path):
    from test_cli import expected_text

    runner = CliRunner()
    base, corpus = _profile_and_corpus(tiny_models, tmp_path, " ".join(str(i % 37) for i in range(600)))
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


def _no_model_loads(monkeypatch):
    """Every option below must be refused before a model loads."""
    import specdraft.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def test_train_head_refuses_folders_it_did_not_write_before_loading(tiny_models, tmp_path, monkeypatch):
    _no_model_loads(monkeypatch)
    runner = CliRunner()
    base, corpus = _profile_and_corpus(tiny_models, tmp_path, "some text " * 200)
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
    base, corpus = _profile_and_corpus(tiny_models, tmp_path, "some text " * 200)
    for extra, message in ((["--epochs", "nan"], "--epochs"), (["--epochs", "inf"], "--epochs"),
                           (["--epochs", "1e300"], "--epochs"), (["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"),
                           (["--lr", "-inf"], "--lr"), (["--seq-len", "4"], "--seq-len"), (["--batch", "0"], "--batch"),
                           (["--steps", "0"], "--steps"), (["--draft-vocab", "1"], "--draft-vocab"),
                           (["--minutes", "0"], "--minutes"), (["--minutes", "nan"], "--minutes"),
                           # the tokens --max-tokens keeps, not the whole stream's count
                           (["--max-tokens", "1", "--seq-len", "64"], "--max-tokens 1: makes fewer than 2 sequences")):
        result = runner.invoke(app, ["train", "head", "--pool", str(base), "--data", str(corpus),
                                     "--out", str(tmp_path / "h"), *extra])
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (extra, result.stderr)


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

