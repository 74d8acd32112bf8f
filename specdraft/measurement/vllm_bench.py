"""`specdraft bench --engine vllm`: vLLM plain, vLLM's built-in speculation and specdraft's
proposer on the same prompts at several concurrencies, each configuration in a fresh vLLM
engine (`vllm_worker.py`, a process each), interleaved by concurrency: at each concurrency
every configuration runs once, in turn, before the next concurrency starts.

Reported per concurrency and configuration: output tokens per second over the whole run
(all prompts, `concurrency` in flight), per-request latency (median, p95, seconds from
submission to the last token), the ratio to vLLM plain and to the best built-in method of
the same concurrency, and how many greedy outputs differ from vLLM plain's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from specdraft.errors import SpecdraftError
from specdraft.measurement.datasets import Example
from specdraft.profile import Profile
from specdraft.serving import launch
from specdraft.session.prompt_ids import prompt_token_ids

PLAIN, SPECDRAFT = "vllm plain", "specdraft proposer"
WARM_UP_PROMPT = "Hello"


@dataclass(frozen=True)
class EngineConfig:
    label: str
    speculative: dict | None
    built_in: bool  # one of vLLM's own methods (the "best built-in" column compares with these)


def engine_configs(draft_tokens: int) -> list[EngineConfig]:
    """vLLM plain, its ngram method at the profile's draft length and at 3 tokens (the
    length that loses least where drafts are rarely accepted), its suffix method where its
    package (arctic-inference) is installed, and specdraft's proposer."""
    import importlib.util

    configs = [EngineConfig(PLAIN, None, False)]
    for k in sorted({draft_tokens, 3}, reverse=True):
        configs.append(EngineConfig(f"vllm ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}, True))
    if importlib.util.find_spec("arctic_inference") is not None:
        configs.append(EngineConfig(f"vllm suffix k={draft_tokens}",
                                    {"method": "suffix", "num_speculative_tokens": draft_tokens}, True))
    configs.append(EngineConfig(SPECDRAFT, launch.speculative_config(draft_tokens), False))
    return configs


def run_config(job: dict, log: Path) -> dict:
    """One configuration in its own process; vLLM's own output goes to `log`."""
    with open(log, "ab") as stderr:
        done = subprocess.run([sys.executable, "-m", "specdraft.measurement.vllm_worker"], input=json.dumps(job).encode(),
                              stdout=subprocess.PIPE, stderr=stderr, env=dict(os.environ), check=False)
    if done.returncode != 0:
        raise SpecdraftError(f"vLLM run failed (exit {done.returncode}); its log: {log}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def cpu_kv_cache_bytes() -> int | None:
    """The KV cache vLLM gets on a CPU: SPECDRAFT_VLLM_KV_GIB GiB (1 by default; 0: none
    asked, vLLM takes its memory fraction of the NUMA node instead)."""
    gib = _env_number("SPECDRAFT_VLLM_KV_GIB", "1", lambda v: v >= 0, "a size in GiB, 0 or more")
    return int(gib * 2**30) or None


def memory_fraction() -> float:
    """vLLM's `gpu_memory_utilization`: SPECDRAFT_VLLM_MEMORY, 0.8 on CUDA and 0.15 on a CPU
    by default."""
    default = "0.8" if launch.cuda_available() else "0.15"
    return _env_number("SPECDRAFT_VLLM_MEMORY", default, lambda v: 0 < v <= 1, "a fraction above 0, at most 1")


def _env_number(name: str, default: str, fits: Callable[[float], bool], expected: str) -> float:
    """The number in environment variable `name` (`default` when unset); SpecdraftError
    naming it when that is not a number that `fits`."""
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or not fits(value):
        raise SpecdraftError(f"{name}={text!r}: expected {expected}")
    return value


def run_vllm_bench(profile: Profile, pool_file: Path, examples: Sequence[Example], concurrencies: Sequence[int],
                   chat: bool | None, log: Path, say: Callable[[str], None], repeats: int = 1) -> list[dict]:
    """Rows: one per (concurrency, configuration), in run order; with `repeats` > 1 every
    configuration runs that many times, the configurations interleaved within each pass,
    and a row pools its runs (`pool_repeats`)."""
    from transformers import AutoTokenizer

    dtype = "bfloat16" if launch.cuda_available() else "float32"
    model = launch.exported_target(profile, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [prompt_token_ids(tokenizer, e.prompt, chat) for e in examples]
    warm_up = prompt_token_ids(tokenizer, WARM_UP_PROMPT, chat)
    n = profile.decode.max_new_tokens
    base = {"model": str(model), "dtype": dtype, "enforce_eager": not launch.cuda_available(),
            "max_model_len": min(4096, max(len(p) for p in prompts) + n + 16), "max_new_tokens": n,
            "memory_fraction": memory_fraction(),
            # On a CPU vLLM takes its fraction of the NUMA node's memory less what the worker
            # already holds, which on a node of a few GiB leaves nothing for the KV cache: ask
            # for a size instead (GiB; SPECDRAFT_VLLM_KV_GIB, 0 keeps the fraction).
            "kv_cache_bytes": None if launch.cuda_available() else cpu_kv_cache_bytes(),
            "prompts": prompts, "warm_up": warm_up,
            "env": launch.proposer_environment(pool_file, None)}
    runs = []
    for concurrency in concurrencies:
        for repeat in range(repeats):
            for config in engine_configs(profile.decode.draft_tokens):
                which = f", run {repeat + 1} of {repeats}" if repeats > 1 else ""
                say(f"concurrency {concurrency}{which}: {config.label} ({len(prompts)} prompts, {n} new tokens each)")
                began = time.perf_counter()
                result = run_config({**base, "concurrency": concurrency, "speculative_config": config.speculative}, log)
                runs.append({"concurrency": concurrency, "config": config.label, "built_in": config.built_in,
                             "tokens": result["tokens"], "latency": result["latency"], "seconds": result["seconds"],
                             "tasks": [e.task for e in examples], "wall_with_start": time.perf_counter() - began})
    return summarize(pool_repeats(runs))


def pool_repeats(runs: list[dict]) -> list[dict]:
    """One row per (concurrency, configuration) from its runs, in first-run order: every
    run's outputs and latencies in run order (so outputs compare with vLLM plain's run by
    run), seconds summed (tokens/s over all runs together), each run's tokens/s in `per_run`
    (the spread between runs of one configuration is this machine's noise)."""
    pooled: dict[tuple[int, str], dict] = {}
    for run in runs:
        produced = sum(len(t) for t in run["tokens"])
        rate = produced / run["seconds"] if run["seconds"] > 0 else 0.0
        row = pooled.get((run["concurrency"], run["config"]))
        if row is None:
            pooled[(run["concurrency"], run["config"])] = {
                **run, "tokens": list(run["tokens"]), "latency": list(run["latency"]), "tasks": list(run["tasks"]),
                "per_run": [rate]}
            continue
        for key in ("tokens", "latency", "tasks"):
            row[key] += run[key]
        row["seconds"] += run["seconds"]
        row["wall_with_start"] += run["wall_with_start"]
        row["per_run"].append(rate)
    return list(pooled.values())


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(rows: list[dict]) -> list[dict]:
    """Adds tokens/s, latency, ratios and greedy differences to each row."""
    for row in rows:
        produced = sum(len(t) for t in row["tokens"])
        row["output_tokens"] = produced
        row["tokens_per_s"] = produced / row["seconds"] if row["seconds"] > 0 else 0.0
        row["latency_median"] = statistics.median(row["latency"])
        row["latency_p95"] = percentile(row["latency"], 0.95)
    for concurrency in sorted({r["concurrency"] for r in rows}):
        same = [r for r in rows if r["concurrency"] == concurrency]
        plain = next((r for r in same if r["config"] == PLAIN), None)
        built_in = [r["tokens_per_s"] for r in same if r["built_in"]]
        for row in same:
            if plain is not None:
                row["vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                row["differing"] = sum(a != b for a, b in zip(row["tokens"], plain["tokens"]))
            if built_in:
                row["vs_best_built_in"] = row["tokens_per_s"] / max(built_in)
    return rows


def table_rows(rows: list[dict]) -> list[dict[str, Any]]:
    """What the table shows (and --out writes without the token lists)."""
    keys = ("concurrency", "config", "tokens_per_s", "vs_plain", "vs_best_built_in", "latency_median", "latency_p95",
            "differing", "output_tokens", "seconds", "per_run")
    return [{k: r.get(k) for k in keys} for r in rows]
