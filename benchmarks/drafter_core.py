"""Draft time of a profile's model drafter through transformers' forward and through the
lean forward, on the same contexts, interleaved (ratios within one run).

    python benchmarks/drafter_core.py --pool benchmarks/qwen-coder.toml --drafter coder-0.5b \
        --data benchmarks/data/stream-b.jsonl --limit 6 --tokens 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdraft.profile import load_profile
from specdraft.models.cached_lm import CachedLM
from specdraft.runtime import build_runtime
from specdraft.session.prompt_ids import prompt_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per draft")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runtime = build_runtime(load_profile(args.pool))
    drafter = next(d for d in runtime.drafters if d.name == args.drafter)
    model = drafter.causal_lm
    cores = {"transformers": CachedLM(model, logits_size=drafter.ctx.vocab_size),
             "lean": CachedLM(model, logits_size=drafter.ctx.vocab_size, lean=True)}
    prompts = [json.loads(line)["prompt"] for line in open(args.data)][: args.limit]
    seconds = {name: [] for name in cores}
    agree = total = 0
    for prompt in prompts:
        context = prompt_token_ids(runtime.tokenizer, prompt, None)
        for _ in range(args.repeats):
            drafts = {}
            for name, lm in cores.items():  # interleaved: both on the same context, back to back
                drafter.lm = lm
                drafter.reset()
                drafter.propose(context, 1)  # the prompt's prefill, not timed
                drafter.on_commit(0)
                start = time.perf_counter()
                draft = drafter.propose(context, args.tokens)
                seconds[name].append((time.perf_counter() - start) / args.tokens)
                drafts[name] = draft.tokens.tolist()
                drafter.on_commit(0)
            agree += sum(a == b for a, b in zip(drafts["transformers"], drafts["lean"]))
            total += args.tokens
    base = statistics.median(seconds["transformers"])
    for name, values in seconds.items():
        print(f"{name:13s} median {statistics.median(values) * 1000:.1f} ms per drafted token "
              f"({base / statistics.median(values):.2f}x transformers)")
    print(f"same drafted token: {agree}/{total}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
