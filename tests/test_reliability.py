"""What a new user meets first, from the command line on the tiny models: literal
brackets in messages, context-length guards, batch input that keeps going, usage errors
that exit 2, a fast start on errors, and a clean screen after Ctrl-C."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import time

import pytest
from rich.console import Console
from rich.text import Text
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.commands.generate import GenerateOptions, run_generate
from specdraft.commands.io import CommandExit
from specdraft.decoding.engine import SpeculativeEngine
from specdraft.session.stats import GenerationStats
from specdraft.ui.panel import stats_panel
from terminal import Terminal
from test_cli import unannounced

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, ["generate", *map(str, args)], input=input)


def one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = unannounced(result.stderr).strip().splitlines()  # (a loaded machine's notices aside)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# -- 4: brackets are text, never Rich markup ---------------------------------------------


def test_messages_keep_profile_brackets(tmp_path):
    file = tmp_path / "p.toml"
    file.write_text('[decode]\ndraft_tokens = 2\n')
    assert "missing section [target]" in one_line_error(invoke("--pool", file, "hi"))
    file.write_text('[target]\nhub = "a/b"\n[policy]\nname = "ucb"\n')
    assert "a profile without [[drafters]] decodes plainly" in one_line_error(invoke("--pool", file, "hi"))


@pytest.mark.parametrize("args", [("--policy", "[/x]"), ("--policy", "fixed:[/x]")])
def test_policy_flag_with_markup_is_a_usage_error(pool_file, args):
    assert "[/x]" in one_line_error(invoke("--pool", pool_file, *args, "hi"))


def test_toml_key_with_markup_is_named(pool_file):
    pool_file.write_text(pool_file.read_text().replace("[decode]", '[decode]\n"[/x]" = 1'))
    assert 'decode.[/x]: unknown key' in one_line_error(invoke("--pool", pool_file, "hi"))


def test_drafter_named_like_markup_shows_in_panel_and_stats(pool_file):
    pool_file.write_text(pool_file.read_text().replace('name = "lookup"', 'name = "[/x]"'))
    stats = invoke("--pool", pool_file, "--policy", "fixed:[/x]", "--stats", "hello")
    assert stats.exit_code == 0, stats.stderr
    assert "[/x] " in stats.stderr
    panel = invoke("--pool", pool_file, "--policy", "fixed:[/x]", "--panel", "hello")
    assert panel.exit_code == 0, panel.stderr
    assert "drafter [/x]" in panel.stderr


def test_help_shows_brackets_literally():
    assert "[policy] name" in runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).stdout
    assert "[policy] table" in runner.invoke(app, ["calibrate-beta", "--help"], env={"COLUMNS": "200"}).stdout
    import typer.main

    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        for param in sub.params:
            text = getattr(param, "help", None) or ""
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (name, param.name)


def test_fixed_policy_panel_claims_no_unknown_regret():
    stats = GenerationStats(["a", "b"])
    console = Console(file=io.StringIO(), width=200)
    console.print(stats_panel(stats, "fixed"))
    assert "unknown" not in console.file.getvalue()
    console.print(stats_panel(stats, "ucb"))
    assert "unknown (bandit feedback)" in console.file.getvalue()


def test_regret_says_its_unit_in_the_panel_and_the_json():
    """Issue 38: a regret in tokens per second (goodput) and one in accepted tokens read the
    same without their unit; the panel, --json and bench say which."""
    from specdraft.decoding.records import RoundLearning, RoundRecord, RoundTimes

    def record(values, unit):
        return RoundRecord(arm=0, drafter="lookup", drafted=2, accepted=1, tokens=[5, 6], alphas=[1.0, 0.0],
                           times=RoundTimes(draft_s=0.001, verify_s=0.01),
                           learning=RoundLearning(evaluated=[(0, [[1.0, 0.0], None])], values=[values], value_unit=unit))

    for unit, phrase in (("tok/s", "tok/s summed over 2 rounds"), ("tokens", "tokens over 2 rounds")):
        stats = GenerationStats(["lookup", "early-exit-24"], 4)
        stats.add(record([190.0, None], unit))  # early-exit-24 skipped: it earns nothing
        stats.add(record([180.0, 200.0], unit))
        assert stats.best_drafter == "lookup" and stats.regret == 0.0
        out = stats.as_dict()
        assert out["regret_unit"] == unit and out["regret_rounds"] == 2 and out["best_drafter"] == "lookup"
        console = Console(file=io.StringIO(), width=300)
        console.print(stats_panel(stats, "normalhedge"))
        assert f"regret 0.00 {phrase} (best lookup)" in console.file.getvalue()
    unpriced = GenerationStats(["lookup", "early-exit-24"], 4)
    unpriced.add(record([None, 120.0], "tok/s"))  # the chosen drafter's cost not known yet
    assert unpriced.regret is None and unpriced.as_dict()["regret_unit"] is None
    console = Console(file=io.StringIO(), width=300)
    console.print(stats_panel(unpriced, "normalhedge"))
    assert "regret not yet known" in console.file.getvalue()


# -- 5: the context length ----------------------------------------------------------------


def test_prompt_longer_than_the_context_is_refused(pool_file):
    message = one_line_error(invoke("--pool", pool_file, "--raw", "x" * 600))
    assert "600 tokens (600 + max_new_tokens 24 = 624 positions)" in message and "context of 512" in message
    assert "--truncate" in message


def test_absurd_prompt_is_refused_before_tokenizing(pool_file, monkeypatch):
    from specdraft.session import prompt_ids

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(prompt_ids, "prompt_token_ids", no_tokenizing)
    message = one_line_error(invoke("--pool", pool_file, input="y" * 2_000_000))
    assert "2000000 characters" in message


def test_truncate_keeps_the_end_of_the_prompt(pool_file):
    result = invoke("--pool", pool_file, "--raw", "--json", "--truncate", "a" * 300 + "b" * 300)
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["tokens"] > 0 and "cut to its last 488 tokens" in result.stderr


def test_budget_without_room_for_a_prompt(pool_file):
    assert "leaves no room for a prompt" in one_line_error(invoke("--pool", pool_file, "-n", "512", "hi"))


# -- 7: batch input -----------------------------------------------------------------------


def test_bad_line_is_reported_and_the_rest_still_runs(pool_file):
    result = invoke("--pool", pool_file, "--each-line", "--json", input=b"first\n\xff\xfebad\nthird\n")
    assert result.exit_code == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["line"], r["prompt"]) for r in records] == [(1, "first"), (3, "third")]
    assert "stdin line 2: not valid UTF-8 (byte 0xff at column 1)" in result.stderr
    assert "1 input line could not be used" in result.stderr


def test_keep_empty_keeps_line_correspondence(pool_file):
    result = invoke("--pool", pool_file, "--each-line", "--json", "--keep-empty", input=b"a\n\n\xffb\nc\n")
    assert result.exit_code == 1
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert records[1]["finish_reason"] == "empty" and records[2]["finish_reason"] == "error"
    text = invoke("--pool", pool_file, "--each-line", "--keep-empty", "--separator", "", "-n", "3", input="a\n\nb\n")
    alone = [invoke("--pool", pool_file, "-n", "3", prompt).stdout for prompt in ("a", "b")]
    assert text.exit_code == 0 and text.stdout == alone[0] + "\n" + alone[1]


@pytest.mark.parametrize("flags, between", [((), "\n"), (("--separator", "\\0"), "\0"),
                                            (("--separator", "\\n---\\n"), "\n---\n")])
def test_each_line_answers_in_plain_text_are_kept_apart(pool_file, flags, between):
    """A blank line (by default) or the --separator after every answer: multi-line answers
    never run together."""
    text = invoke("--pool", pool_file, "--each-line", "--keep-empty", *flags, "-n", "6", input="a\n\nb\n")
    alone = [invoke("--pool", pool_file, "-n", "6", prompt).stdout for prompt in ("a", "b")]
    assert text.exit_code == 0 and text.stdout == alone[0] + between + "\n" + between + alone[1] + between
    refused = invoke("--pool", pool_file, "--separator", "x", "a")
    assert refused.exit_code == 2 and "--separator only applies" in refused.stderr


@pytest.mark.parametrize("data", [b"", b"\n  \n\n"])
def test_input_without_any_prompt_is_a_usage_error(pool_file, data):
    assert "no prompt" in one_line_error(invoke("--pool", pool_file, "--each-line", input=data))


def test_whole_stdin_that_is_not_utf8(pool_file):
    assert "stdin: not valid UTF-8 (byte 0xff on line 2)" in one_line_error(invoke("--pool", pool_file, input=b"ok\n\xff"))


def test_overlong_line_in_a_batch_is_skipped(pool_file):
    result = invoke("--pool", pool_file, "--each-line", "--raw", "--json", "-n", "3", input="a\n" + "x" * 600 + "\nb\n")
    assert result.exit_code == 1 and "stdin line 2: the prompt is 600 tokens" in result.stderr
    assert [json.loads(line)["line"] for line in result.stdout.split("\n") if line] == [1, 3]


# -- 8: usage errors exit 2 ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -1])
def test_out_of_range_seed(pool_file, seed):
    assert "--seed" in one_line_error(invoke("--pool", pool_file, "--seed", seed, "hi"))


@pytest.mark.parametrize("device", ["cuda:abc", "mps", "cuda:7"])
def test_unusable_device_names_the_key(pool_file, device):
    pool_file.write_text(pool_file.read_text().replace('dtype = "float64"', f'dtype = "float64"\ndevice = "{device}"', 1))
    assert "target.device" in one_line_error(invoke("--pool", pool_file, "hi"))


@pytest.mark.parametrize("content", ["[1, 2]", '{"policy": "random", "arms": 3}', "{not json", '"x"'])
def test_bad_policy_state_file(pool_file, tmp_path, content):
    state = tmp_path / "state.json"
    state.write_text(content)
    message = one_line_error(invoke("--pool", pool_file, "--policy-state", state, "hi"))
    assert f"--policy-state {state}" in message


def test_policy_state_garbage_fields_exit_2(pool_file, tmp_path):
    state = tmp_path / "state.json"
    assert invoke("--pool", pool_file, "--policy", "ucb", "--policy-state", state, "-n", "4", "hi").exit_code == 0
    saved = json.loads(state.read_text())
    saved["state"] = {key: "garbage" for key in saved["state"]}
    state.write_text(json.dumps(saved))
    assert f"--policy-state {state}" in one_line_error(invoke("--pool", pool_file, "--policy", "ucb", "--policy-state",
                                                               state, "hi"))


def test_policy_state_of_another_k_or_policy_is_refused_before_the_models_load(pool_file, tmp_path, monkeypatch):
    state = tmp_path / "state.json"
    assert invoke("--pool", pool_file, "--policy", "ucb", "--policy-state", state, "-k", "6", "-n", "4",
                  "hi").exit_code == 0
    assert invoke("--pool", pool_file, "--policy", "ucb", "--policy-state", state, "-k", "6", "-n", "4",
                  "hi").exit_code == 0  # the same settings load it
    import specdraft.runtime

    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded before the policy state was checked")

    monkeypatch.setattr(specdraft.runtime, "build_runtime", refuse)
    message = one_line_error(invoke("--pool", pool_file, "--policy", "ucb", "--policy-state", state, "-k", "4", "hi"))
    assert f"--policy-state {state}" in message and "up to 6 tokens" in message and "-k" in message
    message = one_line_error(invoke("--pool", pool_file, "--policy", "exp3", "--policy-state", state, "-k", "6", "hi"))
    assert f"--policy-state {state}" in message and "'ucb'" in message


# -- 9: first run and the terminal --------------------------------------------------------


def test_profile_errors_import_neither_transformers_nor_torch(tmp_path):
    """A profile mistake is reported in a blink: nothing heavy is imported to find it,
    whichever section holds it (target, a drafter kind's own keys, the policy)."""
    bad = tmp_path / "p.toml"
    bad.write_text("[target]\nhub = 1\n")
    bad_drafter = tmp_path / "d.toml"
    bad_drafter.write_text('[target]\nhub = "org/m"\n[[drafters]]\nname = "l"\nkind = "layers"\nlayers = 0\n')
    bad_policy = tmp_path / "q.toml"
    bad_policy.write_text('[target]\nhub = "org/m"\n[policy]\nname = "ucb"\nobjective = "fast"\n'
                          '[[drafters]]\nname = "l"\nkind = "ngram"\n')
    script = textwrap.dedent(f"""
        import sys
        from typer.testing import CliRunner
        from specdraft.cli import app
        for args in (["generate", "--pool", {str(tmp_path / 'missing.toml')!r}, "x"],
                     ["generate", "--pool", {str(bad)!r}, "x"],
                     ["generate", "--pool", {str(bad_drafter)!r}, "x"],
                     ["bench", "--pool", {str(bad_policy)!r}, "--data", {str(bad)!r}]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, (args, result.output)
        print("transformers" in sys.modules, "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_shell_completion_is_available():
    assert "--install-completion" in runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout


@pytest.mark.parametrize("height, stop_at", [(10, 150), (16, 30), (16, 150)])
def test_ctrl_c_under_the_panel_shows_the_text_once(pool_file, monkeypatch, height, stop_at):
    pool_file.write_text(pool_file.read_text().replace("max_new_tokens = 24", "max_new_tokens = 400"))
    from specdraft.session import text as text_module

    decode = text_module.Detokenizer._decode
    # Printable ASCII only, so the emulated terminal sees one cell per character.
    monkeypatch.setattr(text_module.Detokenizer, "_decode", lambda self, ids: "".join(
        c if c.isascii() and c.isprintable() else "x" for c in decode(self, ids)))
    term = Terminal(60, height)
    original = SpeculativeEngine.generate

    def interrupted(self, prompt_ids, budget=None):
        for i, record in enumerate(original(self, prompt_ids, budget)):
            if i == stop_at:
                time.sleep(0.3)  # let Live's refresh thread draw the frame the user is looking at
                term.write("^C")  # what the tty echoes when the user presses Ctrl-C
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(SpeculativeEngine, "generate", interrupted)
    from specdraft.commands import generate as generate_module

    finish, printed = generate_module.finish_prompt, []
    monkeypatch.setattr(generate_module, "finish_prompt",
                        lambda opts, run, *rest: printed.append(run.text) or finish(opts, run, *rest))
    console = Console(file=term, force_terminal=True, width=60, height=height, highlight=False)
    with pytest.raises(CommandExit) as done:
        run_generate(GenerateOptions(str(pool_file), "hello there", panel=True, policy="fixed:lookup", seed=1,
                                     chat=False), console, stdout=term, stdin=io.StringIO())
    assert done.value.code == 130
    screen, text = term.screen(), printed[0]
    rows = [text[i:i + 60].rstrip() for i in range(0, len(text), 60)]
    start = screen.index(rows[0])
    assert screen[start:start + len(rows)] == rows
    assert screen[start + len(rows)].startswith("interrupted · ")
    leftovers = [row for row in screen[:start] + screen[start + len(rows):] if row and row in text]
    assert leftovers == [], "\n".join(screen)  # a row of the live frame left on screen: the text twice
