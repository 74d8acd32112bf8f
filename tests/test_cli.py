"""The command line: stdout carries only the text (or JSON), everything else goes to
stderr, and bad input gets one line and the documented exit code."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.commands.generate import GenerateOptions, run_generate
from specdraft.commands.io import CommandExit, err_console
from specdraft.decoding.engine import SpeculativeEngine
from specdraft.session.prompt_ids import prompt_token_ids
from tiny import byte_tokenizer, plain_greedy, save_tiny_pair

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, ["generate", *map(str, args)], input=input)


LOAD_NOTICES = ("measuring the target's forward cost", "warning: specdraft: the stored verify costs",
                "warning: specdraft: the machine was busy")


def unannounced(stderr: str) -> str:
    """stderr without the notices a run may print on a loaded machine: the verify-cost probe
    announces itself when it expects to take more than a few seconds, and says when the
    stored costs disagree with the machine or the machine was busy while timing."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith(LOAD_NOTICES))


def expected_text(tiny_models, prompt, max_new=24, chat=True):
    """What plain greedy decoding of the target says, decoded like the CLI decodes."""
    tok = AutoTokenizer.from_pretrained(tiny_models / "target")
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "target").double()
    ids = prompt_token_ids(tok, prompt, chat)
    out = plain_greedy(model, ids, max_new, eos=tok.eos_token_id)
    return tok.decode(out, skip_special_tokens=True)


def test_stdout_is_exactly_the_plain_greedy_text(pool_file, tiny_models):
    result = invoke("--pool", pool_file, "hello there")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected_text(tiny_models, "hello there") + "\n"
    assert unannounced(result.stderr) == ""


def test_raw_prompt_skips_the_chat_template(pool_file, tiny_models):
    result = invoke("--pool", pool_file, "--raw", "abc abc")
    assert result.exit_code == 0
    assert result.stdout == expected_text(tiny_models, "abc abc", chat=False) + "\n"


def test_piped_stdin_is_the_prompt(pool_file):
    assert invoke("--pool", pool_file, input="hello there").stdout == invoke("--pool", pool_file, "hello there").stdout


def test_json_output_has_the_documented_fields(pool_file, tiny_models):
    result = invoke("--pool", pool_file, "--json", "--policy", "fixed:half", "hello there")
    assert result.exit_code == 0 and unannounced(result.stderr) == ""
    record = json.loads(result.stdout)
    assert record["text"] == expected_text(tiny_models, "hello there")
    for key in ("tokens", "rounds", "mean_accepted", "tokens_per_s", "elapsed_s", "drafters"):
        assert key in record
    assert record["drafters"]["half"]["rounds"] == record["rounds"]
    assert record["mean_accepted"] == pytest.approx(record["tokens"] / record["rounds"], abs=1e-3)


def test_json_regret_says_its_unit(pool_file):
    """Issue 38: the regret is in the unit of the policy's objective (tokens per second under
    the default goodput objective), and says so; bandit feedback and fixed have none."""
    record = json.loads(invoke("--pool", pool_file, "--json", "--policy", "normalhedge", "hello there").stdout)
    assert record["regret_unit"] == "tok/s" and record["regret"] is not None
    assert 1 <= record["regret_rounds"] <= record["rounds"] and record["best_drafter"] in record["drafters"]
    for policy in ("ucb", "fixed:half"):
        record = json.loads(invoke("--pool", pool_file, "--json", "--policy", policy, "hello there").stdout)
        assert record["regret"] is None and record["regret_unit"] is None


def test_each_line_gives_one_record_per_nonblank_line(pool_file, tiny_models):
    result = invoke("--pool", pool_file, "--each-line", "--json", input="first\n\nsecond one\n")
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["first", "second one"]
    assert records[1]["text"] == expected_text(tiny_models, "second one")


def test_overrides_reach_the_decoder(pool_file):
    record = json.loads(invoke("--pool", pool_file, "--json", "-n", "5", "-k", "2", "hi").stdout)
    assert record["tokens"] <= 5
    assert all(d["drafted"] <= 2 * d["rounds"] for d in record["drafters"].values())


def test_stop_strings_cut_the_text(pool_file, tiny_models):
    full = expected_text(tiny_models, "hello there")
    # An ASCII character: random bytes decode to U+FFFD runs that only a whole decode counts alike.
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isprintable())
    pool_file.write_text(pool_file.read_text().replace("max_new_tokens = 24", f"max_new_tokens = 24\nstop = [{json.dumps(stop)}]"))
    result = invoke("--pool", pool_file, "--json", "hello there")
    record = json.loads(result.stdout)
    assert record["text"] == full[: full.index(stop)] and record["finish_reason"] == "stop"


def test_forced_panel_keeps_stdout_whole(pool_file, tiny_models):
    result = invoke("--pool", pool_file, "--panel", "hello there")
    assert result.exit_code == 0
    assert result.stdout == expected_text(tiny_models, "hello there") + "\n"
    assert "mean accepted" in result.stderr


@pytest.mark.parametrize(
    "edit, message",
    [
        (('kind = "ngram"', 'kind = "ngarm"'), 'drafters[0].kind: unknown kind "ngarm"'),
        (("layers = 2", "layers = 9"), "drafters[2].layers: must be between 1 and 2"),
        (('path = "{root}/drafter"', 'path = "{root}/nowhere"'), "drafters[1].path: model path not found"),
    ],
)
def test_profile_errors_exit_2_with_one_line(pool_file, tiny_models, edit, message):
    old, new = (s.format(root=tiny_models) for s in edit)
    pool_file.write_text(pool_file.read_text().replace(old, new))
    result = invoke("--pool", pool_file, "hi")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert message in result.stderr and str(pool_file) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_drafter_with_another_tokenizer_is_refused(pool_file, tiny_models, tmp_path):
    other = save_tiny_pair(tmp_path / "other", seed=3)
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    pool_file.write_text(pool_file.read_text().replace(f"{tiny_models}/drafter", str(other)))
    result = invoke("--pool", pool_file, "hi")
    assert result.exit_code == 2
    assert "drafters[1]: tokenizer differs from the target's" in result.stderr


@pytest.mark.parametrize("args, input, message", [
    ((), "", "the prompt is empty"),
    (("   ",), None, "the prompt is empty"),
    (("--each-line", "x"), "a\n", "--each-line reads prompts from stdin"),
])
def test_usage_errors_exit_2(pool_file, args, input, message):
    result = invoke("--pool", pool_file, *args, input=input)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


def test_missing_profile_exits_2(tmp_path):
    result = invoke("--pool", tmp_path / "nope.toml", "hi")
    assert result.exit_code == 2 and "profile file not found" in result.stderr


def test_ctrl_c_prints_committed_text_and_exits_130(pool_file, monkeypatch):
    original = SpeculativeEngine.generate

    def interrupted(self, prompt_ids, budget=None):
        for i, record in enumerate(original(self, prompt_ids, budget)):
            if i == 3:
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(SpeculativeEngine, "generate", interrupted)
    stdout = io.StringIO()
    console = err_console()
    with pytest.raises(CommandExit) as done:
        run_generate(GenerateOptions(str(pool_file), "hello there", json_output=True, policy="fixed:half"),
                     console, stdout=stdout, stdin=io.StringIO())
    assert done.value.code == 130
    record = json.loads(stdout.getvalue())
    assert record["finish_reason"] == "interrupted" and record["rounds"] == 3 and record["tokens"] > 0


def test_closed_pipe_ends_quietly(pool_file):
    command = f"{sys.executable} -m specdraft generate --pool {pool_file} --raw -n 200 'hello' | head -c 3"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert unannounced(proc.stderr.decode()) == ""


def _commands(group, prefix=()):
    """(command path, click command) of every leaf command of the CLI."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer vendors its own click classes)
            yield from _commands(command, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), command


def test_every_command_shows_examples_that_parse_against_its_options():
    """`--help` of every command ends with examples, and each example's arguments are ones
    the command accepts (parsed by click itself, nothing run)."""
    import shlex

    import typer

    from specdraft.cli.examples import EXAMPLES

    commands = dict(_commands(typer.main.get_command(app)))
    assert set(commands) == set(EXAMPLES)
    for path, command in commands.items():
        shown = CliRunner().invoke(app, [*path.split(), "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "Examples" in shown.stdout, path
        for example in EXAMPLES[path]:
            words = shlex.split(example.split("|")[-1].split(">")[0])
            assert words[: 1 + len(path.split())] == ["specdraft", *path.split()], example
            command.make_context(path, words[1 + len(path.split()):])  # a flag that is gone raises here
