"""One prompt through the engine: rounds to streamed text, stop strings, statistics, and
the JSON record a `--json` run prints.

This is the layer between the token-only engine and the terminal: it owns the
detokenizer, so the engine never sees text and the CLI never sees tokens. The prompt's
token ids come from prompt_ids.py, which fits them to the models' context.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from specdraft.decoding.records import RoundRecord
from specdraft.runtime import Runtime
from specdraft.session.prompt_ids import NO_FRAME, ChatFrame, context_limit, fitted_prompt_ids
from specdraft.session.stats import GenerationStats
from specdraft.session.text import Detokenizer, StopStringFilter

# Rounds between refreshes of the planner's estimates in the statistics (the panel's ideal
# speedup): reading them walks every arm's draft lengths, a cost worth paying once in a
# while for a display, not every round; the last round's are read when the run ends.
ESTIMATES_EVERY = 16


class PromptRun:
    """Iterate to run; each step yields (text that became final this round, the round's record)."""

    def __init__(self, runtime: Runtime, prompt: str, chat: bool | None = None, truncate: bool = False,
                 frame: ChatFrame = NO_FRAME, stops: Sequence[str] = (), budget: int | None = None):
        self.runtime = runtime
        self.prompt = prompt
        self.budget = budget  # at most this many tokens, below the profile's max_new_tokens (None: that)
        self.prompt_ids, self.truncated = fitted_prompt_ids(runtime.tokenizer, prompt, chat, context_limit(runtime),
                                                            truncate, frame)
        self.detokenizer = Detokenizer(runtime.tokenizer)
        self.stops = StopStringFilter((*runtime.profile.decode.stop, *stops))  # a request's own after the profile's
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
        rounds = self.runtime.engine.generate(self.prompt_ids, self.budget)
        try:
            for record in rounds:
                self.records.append(record)
                self.stats.add(record)
                if len(self.records) % ESTIMATES_EVERY == 1:
                    self.stats.learn_estimates(self.runtime.engine.driver.planner)
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
            self.stats.learn_estimates(self.runtime.engine.driver.planner)
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
