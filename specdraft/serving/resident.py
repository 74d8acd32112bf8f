"""The resident server (`specdraft serve`): one loaded model and its learned policy behind an
OpenAI-compatible HTTP API, on specdraft's own engine.

One request decodes at a time (a lock; the others wait their turn in their own threads, as
llama-server with one slot does); the model, the drafters' learned text and the policy stay
between requests, and a request whose prompt begins with what the previous one left in the
target's cache prefills only the rest (engine's PrefixCache). Streaming is server-sent
events, `data: {chunk}` lines ending with `data: [DONE]`. A client that goes away mid-stream
stops its decoding. Bound to 127.0.0.1 unless told otherwise. Concurrency at scale is vLLM's
(`serve --engine vllm`).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from specdraft.errors import UsageError
from specdraft.serving.sampling_rules import RuleError, RuntimesByRule
from specdraft.serving.openai_api import ApiError, Decoded, Request, Usage, chunk, completion_id, finish_reason, \
    parse_request, response

log = logging.getLogger("specdraft")
MAX_BODY = 16 << 20  # bytes of a request body


class Resident:
    """The loaded runtime and the one-at-a-time decoding of requests."""

    def __init__(self, runtime, model_name: str):
        self.runtime, self.model_name = runtime, model_name
        self.lock = threading.Lock()
        self.budget = runtime.profile.decode.max_new_tokens
        self.rules = RuntimesByRule(runtime)  # a request at another sampling rule decodes on its own runtime
        self.served = 0

    def parse(self, body: Any, chat: bool) -> Request:
        return parse_request(body, chat, self.budget)

    def decode(self, request: Request, emit: Callable[[str], None]) -> Decoded:
        """Decode `request`, calling `emit(text)` as text is committed. Waits for the requests
        before it."""
        from specdraft.session.prompt_ids import ChatFrame
        from specdraft.session.prompt_run import PromptRun

        with self.lock:
            try:
                runtime = self.rules.runtime_for(request.sampling)
            except RuleError as exc:
                raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
            try:
                run = PromptRun(runtime, request.prompt, request.chat,
                                frame=ChatFrame(request.system, request.turns), stops=request.stop,
                                budget=request.max_tokens)
            except UsageError as exc:  # too long for the context, empty, no chat template
                raise ApiError(400, str(exc)) from None
            try:
                for delta, _ in run:
                    if delta:
                        emit(delta)
            except BrokenPipeError:
                runtime.engine.prefix.forget()
                raise
            self.served += 1
            log.info("request %d: %d prompt tokens (%d prefilled), %d tokens at %.1f tok/s", self.served,
                     len(run.prompt_ids), run.stats.prefill_tokens, run.stats.tokens, run.stats.tokens_per_s)
            cached = len(run.prompt_ids) - 1 - run.stats.prefill_tokens
            return Decoded(run.text, finish_reason(run.finish), Usage(len(run.prompt_ids), run.stats.tokens, cached))


class Handler(BaseHTTPRequestHandler):
    """The API's routes over `resident` (set by make_handler)."""

    resident: Resident
    protocol_version = "HTTP/1.1"
    server_version = "specdraft"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": self.resident.model_name, "object": "model",
                                                         "owned_by": "specdraft"}]})
        elif self.path.rstrip("/") in ("/health", ""):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, ApiError(404, f"no route {self.path}", "not_found_error").body())

    def do_POST(self) -> None:  # noqa: N802
        route = self.path.rstrip("/")
        chat = route in ("/v1/chat/completions", "/chat/completions")
        if not chat and route not in ("/v1/completions", "/completions"):
            self._json(404, ApiError(404, f"no route {self.path}", "not_found_error").body())
            return
        try:
            request = self.resident.parse(self._body(), chat)
            if request.stream:
                self._stream(request)
            else:
                ident = completion_id(chat)
                done = self.resident.decode(request, lambda piece: None)
                self._json(200, response(request, ident, self.resident.model_name, done))
        except ApiError as exc:
            self._json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(400, "Content-Length is not a number") from None
        if not 0 < length <= MAX_BODY:
            raise ApiError(413 if length > MAX_BODY else 400, f"a request body of 1 to {MAX_BODY} bytes, please")
        try:
            return json.loads(self.rfile.read(length))
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not JSON") from None

    def _stream(self, request: Request) -> None:
        ident, started = completion_id(request.chat), [False]

        def send(event: dict | str) -> None:
            if not started[0]:  # headers only once decoding can start: a bad request still gets a 400
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                started[0] = True
            data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        first = [True]

        def emit(piece: str) -> None:
            send(chunk(request, ident, self.resident.model_name, piece, None, first=first[0]))
            first[0] = False

        done = self.resident.decode(request, emit)
        send(chunk(request, ident, self.resident.model_name, None, done.finish, first=first[0],
                   usage=done.usage if request.include_usage else None))
        send("[DONE]")
        self.close_connection = True

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def make_handler(resident: Resident) -> type[BaseHTTPRequestHandler]:
    return type("ResidentHandler", (Handler,), {"resident": resident})


def serve_forever(resident: Resident, host: str, port: int, ready: Callable[[str], None]) -> None:
    """Serve until interrupted; `ready(url)` once the socket listens."""
    try:
        server = ThreadingHTTPServer((host, port), make_handler(resident))
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    server.daemon_threads = True
    ready(f"http://{host}:{server.server_address[1]}/v1")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
