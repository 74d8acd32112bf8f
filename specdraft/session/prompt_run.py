"""One prompt through the engine: prompt text to token ids, rounds to streamed text,
stop strings, statistics, and the JSON record a `--json` run prints.

This is the layer between the token-only engine and the terminal: it owns the tokenizer
calls, so the engine never sees text and the CLI never sees tokens.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from specdraft.decoding.engine import RoundRecord
from specdraft.errors import UsageError
from specdraft.runtime import Runtime
from specdraft.session.stats import GenerationStats
from specdraft.session.text import Detokenizer, StopStringFilter


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool | None) -> list[int]:
    """Token ids for `prompt`; chat=None uses the chat template when the tokenizer has one."""
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        if not has_chat_template(tokenizer):
            raise UsageError("--chat: this tokenizer has no chat template; use --raw")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UsageError("the prompt tokenizes to nothing")
    return list(ids)


class PromptRun:
    """Iterate to run; each step yields (text that became final this round, the round's record)."""

    def __init__(self, runtime: Runtime, prompt: str, chat: bool | None = None):
        self.runtime = runtime
        self.prompt = prompt
        self.prompt_ids = prompt_token_ids(runtime.tokenizer, prompt, chat)
        self.detokenizer = Detokenizer(runtime.tokenizer)
        self.stops = StopStringFilter(runtime.profile.decode.stop)
        self.stats = GenerationStats([d.name for d in runtime.drafters], runtime.profile.decode.draft_tokens)
        self.pieces: list[str] = []
        self.records: list[RoundRecord] = []
        self.finish: str | None = None
        self._start = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def __iter__(self) -> Iterator[tuple[str, RoundRecord]]:
        self._start = time.perf_counter()
        rounds = self.runtime.engine.generate(self.prompt_ids)
        try:
            for record in rounds:
                self.records.append(record)
                self.stats.add(record)
                self.stats.elapsed_s = time.perf_counter() - self._start
                delta = self.stops.push(self.detokenizer.add(record.tokens))
                if record.finish and not self.stops.stopped:
                    delta += self.stops.push(self.detokenizer.flush())  # may still hit a stop string
                    delta += self.stops.flush()
                self.finish = "stop" if self.stops.stopped else record.finish
                self.pieces.append(delta)
                yield delta, record
                if self.finish:
                    break
        finally:
            rounds.close()
            self.stats.elapsed_s = time.perf_counter() - self._start

    def interrupt(self) -> str:
        """Mark the run interrupted; return committed text not yet emitted."""
        self.finish = self.finish or "interrupted"
        rest = self.stops.push(self.detokenizer.flush()) + self.stops.flush()
        self.pieces.append(rest)
        return rest

    def run(self) -> "PromptRun":
        for _ in self:
            pass
        return self

    def record(self) -> dict:
        """The `--json` object for this prompt."""
        return {
            "prompt": self.prompt,
            "text": self.text,
            "finish_reason": self.finish,
            **self.stats.as_dict(),
            "policy": self.runtime.profile.policy.name,
        }
