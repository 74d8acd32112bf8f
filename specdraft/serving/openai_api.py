"""The OpenAI-compatible request and response shapes the resident server speaks
(`/v1/completions`, `/v1/chat/completions`, their streamed chunks), checked and built here in
plain Python: no HTTP, no model.

A request's problems are `ApiError`s with the HTTP status and OpenAI's error object. What a
request may set: `max_tokens` (up to the server's budget), `stop` (a string or a list),
`stream`, and its own sampling rule: `temperature`, `top_p`, `top_k`, `repeat_penalty`
(llama-server's names for the last two) and `seed`; the server checks their ranges as a
profile's. OpenAI's `frequency_penalty` and `presence_penalty` are refused unless 0 rather
than ignored: `repeat_penalty` is the penalty this server applies.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Request:
    chat: bool
    prompt: str  # the completion prompt, or the last user message of a chat
    system: str | None  # a chat's system message (None: the template's default)
    turns: tuple[tuple[str, str], ...]  # a chat's earlier messages
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: the last chunk carries the usage
    # The request's own sampling rule, as (profile decode key, value) for what it set.
    sampling: tuple[tuple[str, float | int], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the target's cache already held (not prefilled again)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class Decoded:
    text: str
    finish: str  # OpenAI's finish reason
    usage: Usage


SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repeat_penalty": "repeat_penalty",
                 "seed": "seed"}  # request key -> profile decode key
WHOLE_NUMBERS = ("top_k", "seed")


def parse_request(body: Any, chat: bool, budget: int) -> Request:
    """The request `body` (parsed JSON) of a completion (`chat` False) or a chat completion."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = budget
    if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
        raise ApiError(400, "max_tokens must be a positive whole number", param="max_tokens")
    sampling = _sampling(body)
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one choice per request", param="n")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 16):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 16", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    if chat:
        system, turns, prompt = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
        system, turns = None, ()
    return Request(chat, prompt, system, turns, min(max_tokens, budget), tuple(stop), stream, include_usage, sampling)


def _sampling(body: dict) -> tuple[tuple[str, float | int], ...]:
    """The sampling rule the request sets (ranges are the profile's, checked by the server)."""
    for name in ("frequency_penalty", "presence_penalty"):
        given = body.get(name)
        if given not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported: this server applies repeat_penalty (llama.cpp's)",
                           param=name)
    out = []
    for name, key in SAMPLING_KEYS.items():
        given = body.get(name)
        if given is None:
            continue
        whole = name in WHOLE_NUMBERS
        if isinstance(given, bool) or not isinstance(given, int if whole else (int, float)) \
                or not math.isfinite(given):
            raise ApiError(400, f"{name} must be a {'whole number' if whole else 'number'}", param=name)
        out.append((key, given if whole else float(given)))
    return tuple(out)


def _messages(messages: Any) -> tuple[str | None, tuple[tuple[str, str], ...], str]:
    if not (isinstance(messages, list) and messages):
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    system, turns = None, []
    for i, message in enumerate(messages):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (None, None)
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if role not in ROLES or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}]: expected a role of {', '.join(ROLES)} and text content",
                           param="messages")
        if role == "system" and i == 0:
            system = content
        else:
            turns.append((role, content))
    if not turns or turns[-1][0] != "user" or not turns[-1][1].strip():
        raise ApiError(400, "the last message must be the user's, with text", param="messages")
    return system, tuple(turns[:-1]), turns[-1][1]


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def response(request: Request, ident: str, model: str, done: Decoded) -> dict:
    """The whole (not streamed) response object."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish}
    if request.chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice.update(text=done.text, logprobs=None)
    return {"id": ident, "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": done.usage.as_dict()}


def chunk(request: Request, ident: str, model: str, text: str | None, finish: str | None, first: bool = False,
          usage: Usage | None = None) -> dict:
    """One streamed chunk: a piece of text, or the last one with the finish reason (and the
    usage, when asked for)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice.update(text=text or "", logprobs=None)
    out = {"id": ident, "object": "chat.completion.chunk" if request.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice]}
    if usage is not None:
        out["usage"] = usage.as_dict()
    return out


def finish_reason(finish: str | None) -> str:
    """OpenAI's names: "stop" for an end of text or a stop string, "length" for the budget."""
    return "length" if finish == "length" else "stop"
