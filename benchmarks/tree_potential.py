"""What a token tree of several drafters could give over one drafter, from a trace (greedy).

Per prompt of a `specdraft trace` file, rounds are replayed along the traced trajectory: one
drafter alone commits its accepted run + 1 a round; a tree of several commits the longest of
their runs + 1 (the target follows its argmax down the merged tree). Each round costs a verify
at its width (1 + the tokens drafted; no shared prefix merged, so a tree's width is an upper
bound) plus a one-token forward of the drafter per token it drafted (the trace's costs), in
units of the target's one-token step.
Draft lengths are capped at each of `--caps`; no planning (every drafter drafts what it would
at every round), so this bounds what the merged chains add, not what a planner would reach.

    specdraft trace --pool profiles/demo.toml --data benchmarks/data/stream-f.jsonl --out trace.jsonl -n 64
    python benchmarks/tree_potential.py trace.jsonl --widths 1,1.00,1.17,1.46,1.49,1.57,1.63,1.82,1.84,2.01,2.04

`--widths`: the verify cost at widths 1, 2, .. as multiples of width 1 (e.g. a column of
README's width table; extended linearly past the last); default the trace's own line.
"""

from __future__ import annotations

import argparse
import json


def width_cost(ratios: list[float]):
    def cost(width: int) -> float:
        if width <= len(ratios):
            return ratios[width - 1]
        return ratios[-1] + (width - len(ratios)) * (ratios[-1] - ratios[-2])
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--widths", help="verify cost at widths 1, 2, .. as multiples of width 1")
    parser.add_argument("--caps", default="2,4,6,10", help="draft-length caps to replay")
    args = parser.parse_args()
    lines = [json.loads(line) for line in open(args.trace)]
    header, prompts = lines[0], lines[1:]
    target = header["costs"]["target"]
    step = target["fixed"] + target["per_token"]
    if args.widths:
        cost = width_cost([float(r) for r in args.widths.split(",")])
    else:
        cost = width_cost([(target["fixed"] + w * target["per_token"]) / step for w in range(1, 3)])
    names = [name for name in header["drafters"] if name != "none"]
    # A drafter drafts one token a forward: each costs its whole one-token forward.
    per_token = {name: (header["costs"][name]["fixed"] + header["costs"][name]["per_token"]) / step
                 for name in names}
    configs = {name: [name] for name in names}
    for size in range(2, len(names) + 1):
        configs[" + ".join(names[:size])] = names[:size]
    for cap in (int(c) for c in args.caps.split(",")):
        print(f"draft length cap {cap}")
        for label, members in configs.items():
            tokens = seconds = rounds = widths = 0.0
            for prompt in prompts:
                lanes = prompt["drafters"]
                position = 0
                while position < len(prompt["tokens"]):
                    runs = [min(lanes[m]["run"][position], cap) for m in members]
                    drafted = [min(lanes[m]["drafted"][position], cap) for m in members]
                    width = 1 + sum(drafted)
                    position += max(runs) + 1
                    tokens += max(runs) + 1
                    seconds += cost(width) + sum(per_token[m] * d for m, d in zip(members, drafted))
                    rounds += 1
                    widths += width
            print(f"  {label:40s} committed/round {tokens / rounds:.2f}  width {widths / rounds:5.1f}  "
                  f"est. speedup over plain {tokens / seconds:.2f}")


if __name__ == "__main__":
    main()
