#!/usr/bin/env python3
"""Synthetic target data for `specdraft train steer` / `train head`: the profile's target
answers training prompts itself (greedy), in batches, as SD2 trains on (the drafter
learns to say what *this* target says, in the style the target writes, not the style of
a dataset's reference answers).

Prompts come one per line (.txt) or as JSONL lines with a "prompt" field; answers are
written as JSONL {"prompt", "answer"} exchanges, which the training commands read in the
chat template. Answers are cut at the first of the target's end tokens (`eos_token_ids`, the
ones specdraft's own decoding stops at) or at --max-new-tokens.
Resumable: prompts already answered in --out are skipped, and every batch is appended as
soon as it is done (Ctrl-C loses at most the batch in flight).

Batched greedy generation (left padded) is what makes this affordable on a CPU: a decode
step is bound by reading the weights, so a batch of 16 costs little more than one row.

    python tools/make_target_data.py --pool benchmarks/qwen-steer.toml \
        --prompts benchmarks/data/head-train-code.txt benchmarks/data/head-train-math.txt \
        --out /work/steer/target-answers.jsonl --limit 256 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def read_prompts(paths: list[str]) -> list[str]:
    prompts: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                prompts.append(json.loads(line)["prompt"] if path.endswith(".jsonl") else line)
    return prompts


def interleave(groups: list[list[str]]) -> list[str]:
    """One prompt of each file in turn, so a --limit keeps every domain."""
    out, longest = [], max(map(len, groups))
    for i in range(longest):
        out += [g[i] for g in groups if i < len(g)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    import torch

    from specdraft.profile import load_profile
    from specdraft.models.loading import eos_token_ids, load_model
    from specdraft.models.kernels.packed_linear import pack_linears, packing_problem
    from specdraft.session.prompt_ids import prompt_token_ids

    profile = load_profile(args.pool)
    target = load_model(profile.target, str(profile.file), "target")
    model, tokenizer = target.model, target.tokenizer
    if packing_problem(model) is None:  # on a CPU: oneDNN's packed weights, several times faster at batch widths
        pack_linears(model)
    prompts = interleave([read_prompts([p]) for p in args.prompts])[: args.limit]
    done = set()
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            done = {json.loads(line)["prompt"] for line in f if line.strip()}
    todo = [p for p in prompts if p not in done]
    end_ids = sorted(eos_token_ids(model, tokenizer))  # where specdraft's decoding of this target stops
    # padding sits left of each prompt under a zero attention mask: any id serves
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (end_ids[0] if end_ids else 0)
    started, written = time.monotonic(), 0
    print(f"{len(done)} prompts already answered, {len(todo)} to go", file=sys.stderr)
    with open(args.out, "a", encoding="utf-8") as out:
        for first in range(0, len(todo), args.batch):
            batch = todo[first : first + args.batch]
            ids = [prompt_token_ids(tokenizer, p, None) for p in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
            mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
            with torch.inference_mode():
                generated = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                           max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                                           eos_token_id=end_ids or None)[:, width:]
            for prompt, row in zip(batch, generated.tolist()):
                cut = next((i for i, t in enumerate(row) if t in end_ids), len(row))
                out.write(json.dumps({"prompt": prompt, "answer": tokenizer.decode(row[:cut])}) + "\n")
                written += cut
            out.flush()
            elapsed = time.monotonic() - started
            print(f"{first + len(batch)}/{len(todo)} prompts, {written} answer tokens, "
                  f"{written / elapsed:.1f} tok/s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
