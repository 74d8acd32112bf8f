#!/usr/bin/env python3
"""What steering adds to draft time: a `steered` drafter against the pretrained `model`
drafter it steers, drafting the same blocks from the same contexts.

For each exchange (JSONL with a prompt and an answer, e.g. make_target_data.py's output)
the chat-templated prompt plus answer is replayed as a decode that commits --advance
tokens per round. Every round both drafters draft --k tokens from the same context, in
alternating order; the steered one first takes the target's hidden states at the newly
verified positions, as the round hands them over (that hand-over is timed with it). So
both pay the same catch-up and the same draft forwards, and the difference is the
steering: the per-block bias projection, the per-position biases for committed tokens,
and the hooks. The target's hidden states come from one untimed forward per exchange.

    python benchmarks/steer_cost.py --pool benchmarks/qwen-steer.toml \
        --steered steered --pretrained pretrained --data /work/steer2/target-answers.jsonl --limit 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--steered", required=True, help="the pool's steered drafter")
    parser.add_argument("--pretrained", required=True, help="the pool's model drafter it steers")
    parser.add_argument("--data", required=True, help="JSONL lines with prompt and answer")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per block")
    parser.add_argument("--advance", type=int, default=4, help="tokens committed per round")
    args = parser.parse_args()

    import torch

    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime

    runtime = build_runtime(load_profile(args.pool))
    by_name = {d.name: d for d in runtime.drafters}
    steered, pretrained = by_name[args.steered], by_name[args.pretrained]
    tokenizer, target = runtime.tokenizer, runtime.target.model
    rows = [json.loads(line) for line in open(args.data, encoding="utf-8") if line.strip()][: args.limit]
    seconds = {args.pretrained: 0.0, args.steered: 0.0}
    blocks = 0
    _warm_up(tokenizer, rows[0]["prompt"], (steered, pretrained), args.k)
    for number, row in enumerate(rows):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        ids = list(prompt) + list(answer)
        with torch.inference_mode():
            out = target(torch.tensor([ids]), output_hidden_states=True)
        hidden = {layer: out.hidden_states[layer][0] for layer in steered.feature_layers}
        for drafter in (steered, pretrained):
            drafter.reset()
        observed = 0
        for round_index, end in enumerate(range(len(prompt), len(ids), args.advance)):
            context = ids[:end]
            order = (pretrained, steered) if (round_index + number) % 2 == 0 else (steered, pretrained)
            for drafter in order:
                start = time.perf_counter()
                if drafter is steered and end - 1 > observed:  # the verify's hand-over
                    drafter.observe_features(observed, {k: v[observed : end - 1] for k, v in hidden.items()})
                drafter.propose(context, args.k)
                seconds[drafter.name] += time.perf_counter() - start
            observed = end - 1
            blocks += 1
        ratio = seconds[args.steered] / seconds[args.pretrained]
        print(f"{number + 1}/{len(rows)}: {blocks} blocks, steered / pretrained draft time so far {ratio:.3f}",
              flush=True)
    drafted = blocks * args.k
    for name, total in seconds.items():
        print(f"{name}: {total:.1f} s for {blocks} blocks of {args.k}, {total / drafted * 1e3:.1f} ms per drafted token")
    print(f"steering adds {seconds[args.steered] / seconds[args.pretrained] - 1:+.1%} to draft time")


def _warm_up(tokenizer, prompt: str, drafters, k: int) -> None:
    """One untimed draft each: the first forward of a model pays one-off allocations."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for drafter in drafters:
        drafter.reset()
        drafter.propose(ids, k)
        drafter.reset()


if __name__ == "__main__":
    main()
