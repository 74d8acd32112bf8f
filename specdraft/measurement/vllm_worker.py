"""One vLLM configuration of the vLLM bench, run in a process of its own (`python -m
specdraft.measurement.vllm_worker`; a job as JSON on stdin, the result as JSON on stdout,
vLLM's logs on stderr): one engine, one warm-up request, then every prompt with at most
`concurrency` requests in flight (a closed loop, as that many users would keep a server
busy), each request timed from its submission to its last token.

A process per configuration: vLLM's engine holds the process's memory and its engine core
processes until it exits, and a fresh engine per run keeps one configuration's prefix
cache and drafter history out of the next one's timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


async def _run(job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=job["model"], dtype=job["dtype"], enforce_eager=job["enforce_eager"],
                           max_model_len=job["max_model_len"], seed=0, max_num_seqs=max(job["concurrency"], 1),
                           gpu_memory_utilization=job["memory_fraction"],
                           kv_cache_memory_bytes=job.get("kv_cache_bytes"),
                           speculative_config=job["speculative_config"], disable_log_stats=True)
    engine = AsyncLLM.from_engine_args(args)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    try:
        async def one(request_id: str, ids: list[int]) -> tuple[list[int], float]:
            began = time.perf_counter()
            final = None
            async for output in engine.generate({"prompt_token_ids": ids}, params, request_id):
                final = output
            return list(final.outputs[0].token_ids), time.perf_counter() - began

        await one("warm-up", job["warm_up"])
        gate = asyncio.Semaphore(job["concurrency"])

        async def gated(i: int, ids: list[int]) -> tuple[list[int], float]:
            async with gate:
                return await one(f"p{i}", ids)

        began = time.perf_counter()
        results = await asyncio.gather(*(gated(i, ids) for i, ids in enumerate(job["prompts"])))
        wall = time.perf_counter() - began
    finally:
        engine.shutdown()
    return {"tokens": [r[0] for r in results], "latency": [r[1] for r in results], "seconds": wall}


def main() -> int:
    job = json.load(sys.stdin)
    os.environ.update(job.get("env", {}))
    result = asyncio.run(_run(job))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
