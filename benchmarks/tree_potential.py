"""What a token tree of several drafters could give over one drafter, from a trace (greedy).

Per prompt of a `specdraft trace` file, rounds are replayed along the traced trajectory: one
drafter alone commits its accepted run + 1 a round; a tree of several commits the longest of
their runs + 1 (the target follows its argmax down the merged tree). Each round costs a verify
at its width (1 + the tokens drafted; no shared prefix merged, so a tree's width is an upper
bound) plus a one-token forward of the drafter per token it drafted (the trace's costs, each
drafter's scaled by `--draft-cost NAME=X`), in units of the target's one-token step.
Draft lengths are capped at each of `--caps`; no planning (every drafter drafts what it would
at every round), so this bounds what the merged chains add, not what a planner would reach.
A drafter's run past its first token is the trace's (teacher-forced for a head: its later
tokens read the target's real features, so a head's runs are optimistic).

    specdraft trace --pool profiles/demo.toml --data benchmarks/data/stream-f.jsonl --out trace.jsonl -n 64
    python benchmarks/tree_potential.py trace.jsonl --widths 1,1.00,1.17,1.46,1.49,1.57,1.63,1.82,1.84,2.01,2.04

`--widths`: the verify cost at widths 1, 2, .. as multiples of width 1 (e.g. a column of
README's width table; extended linearly past the last); default the trace's own (the target
timed at every width up to K + 1 in traces that have it, else its line).
`--search`: instead, per task (the prompt id's prefix before "-") and over all prompts, the
best single drafter at its best cap against the best tree of two or more drafters, each at a
cap of its own (1, 2, 3, 4 or 6): the most a static tree could give over one drafter.
`--hindsight`: instead, per task and over all prompts, the most any policy could reach: each
round's drafter and draft length (up to the largest of `--caps`) chosen knowing the round's
outcome, the best such sequence of rounds found exactly (`specdraft.measurement.hindsight`;
`specdraft bench --replay` prints the same at the replay's costs), for each drafter
alone and for the whole pool; then the drafter alone chosen in hindsight, each drafting what it
would at a cap of `--caps` (or nothing), against each drafter at its best cap. A tree
commits one member's accepted run + 1 at a width of at least that run + 1 (and pays every
member's drafting), which the round that drafts just that run with that member commits at no
more cost: the pool's figure bounds every policy, chains and trees alike (runner-up leaves
aside: a trace holds none). The pool over its best drafter is what the union can add at all.
"""

from __future__ import annotations

import argparse
import itertools
import json

from specdraft.measurement.hindsight import best_rate
from specdraft.measurement.traces import ForwardCost

SEARCH_CAPS = (1, 2, 3, 4, 6)


def width_cost(ratios: list[float]):
    def cost(width: int) -> float:
        if width <= len(ratios):
            return ratios[width - 1]
        return ratios[-1] + (width - len(ratios)) * (ratios[-1] - ratios[-2])
    return cost


def replay(prompts: list[dict], members: list[tuple[str, int]], cost, per_token: dict[str, float]) -> tuple:
    """(committed tokens, seconds in target steps, rounds, verified rows) of a tree of
    `members` ((drafter, cap) each) replayed on `prompts`."""
    tokens = seconds = rounds = widths = 0.0
    for prompt in prompts:
        lanes = prompt["drafters"]
        position = 0
        while position < len(prompt["tokens"]):
            runs = [min(lanes[m]["run"][position], cap) for m, cap in members]
            drafted = [min(lanes[m]["drafted"][position], cap) for m, cap in members]
            width = 1 + sum(drafted)
            position += max(runs) + 1
            tokens += max(runs) + 1
            seconds += cost(width) + sum(per_token[m] * d for (m, _), d in zip(members, drafted))
            rounds += 1
            widths += width
    return tokens, seconds, rounds, widths


def search(prompts: list[dict], names: list[str], cost, per_token: dict[str, float]) -> None:
    tasks = sorted({p.get("id", "").split("-")[0] for p in prompts})
    for task in [None, *tasks] if len(tasks) > 1 else [None]:
        chosen = [p for p in prompts if task is None or p.get("id", "").split("-")[0] == task]

        def rate(members):
            tokens, seconds, _, _ = replay(chosen, members, cost, per_token)
            return tokens / seconds

        single = max((rate([(m, c)]), m, c) for m in names for c in range(1, 9))
        trees = ([(m, c) for m, c in zip(group, caps)] for size in range(2, len(names) + 1)
                 for group in itertools.combinations(names, size)
                 for caps in itertools.product(SEARCH_CAPS, repeat=size))
        best = max((rate(members), members) for members in trees)
        print(f"{task or 'all'}: best single {single[1]} (cap {single[2]}) est. speedup {single[0]:.3f}; "
              f"best tree {' + '.join(f'{m} (cap {c})' for m, c in best[1])} {best[0]:.3f} "
              f"({best[0] / single[0]:.3f}x the single)")


def hindsight_rate(prompts: list[dict], names: list[str], cost, per_token: dict[str, float], cap: int,
                   any_length: bool) -> float:
    """The highest tokens per step over `prompts` of any sequence of rounds that each draft with
    one of `names` (or not at all), chosen knowing the outcome: at any length 0 .. cap when
    `any_length`, else what the drafter drafts at `cap` (`specdraft.measurement.hindsight`)."""
    def options(prompt: dict):
        lanes = [(m, prompt["drafters"][m]) for m in names]

        def at(position: int):
            out = [(1, cost(1))]
            for m, lane in lanes:
                run, drafted = lane["run"][position], min(lane["drafted"][position], cap)
                for k in range(1, drafted + 1) if any_length else [drafted] if drafted else []:
                    out.append((min(run, k) + 1, cost(1 + k) + per_token[m] * k))
            return out
        return at
    return best_rate([(len(p["tokens"]), options(p)) for p in prompts])


def hindsight(prompts: list[dict], names: list[str], cost, per_token: dict[str, float], caps: list[int]) -> None:
    tasks = sorted({p.get("id", "").split("-")[0] for p in prompts})
    for task in [None, *tasks] if len(tasks) > 1 else [None]:
        chosen = [p for p in prompts if task is None or p.get("id", "").split("-")[0] == task]
        for label, cases in [("drafter and length", [(max(caps), True)]),
                             ("drafter, at each cap", [(cap, False) for cap in caps])]:
            rates = {(m, cap): hindsight_rate(chosen, [m], cost, per_token, cap, free) for m in names
                     for cap, free in cases}
            leader = max(rates, key=rates.get)
            pool = max((hindsight_rate(chosen, names, cost, per_token, cap, free), cap) for cap, free in cases)
            each = ", ".join(f"{m} {max(r for (n, _), r in rates.items() if n == m):.3f}" for m in names)
            print(f"{task or 'all'}: {label} in hindsight, est. speedup {each}; the pool {pool[0]:.3f} "
                  f"({pool[0] / rates[leader]:.3f}x {leader[0]}{'' if len(cases) == 1 else f', caps {pool[1]} and {leader[1]}'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--widths", help="verify cost at widths 1, 2, .. as multiples of width 1")
    parser.add_argument("--caps", default="2,4,6,10", help="draft-length caps to replay")
    parser.add_argument("--draft-cost", action="append", default=[], metavar="NAME=X",
                        help="scale drafter NAME's traced draft cost by X (repeatable)")
    parser.add_argument("--search", action="store_true", help="best single drafter against best static tree")
    parser.add_argument("--hindsight", action="store_true", help="each drafter and the pool played in hindsight")
    args = parser.parse_args()
    lines = [json.loads(line) for line in open(args.trace)]
    header, prompts = lines[0], lines[1:]
    target = ForwardCost(**header["costs"]["target"])
    step = target(1)
    if args.widths:
        cost = width_cost([float(r) for r in args.widths.split(",")])
    else:  # the trace's own: its timed widths where it has them (each the cheapest wider one), else its line
        cost = width_cost([target(w) / step for w in range(1, max(3, len(target.by_width or ())) + 1)])
    names = [name for name in header["drafters"] if name != "none"]
    scale = {name: float(x) for name, x in (item.split("=", 1) for item in args.draft_cost)}
    # A drafter drafts one token a forward: each costs its whole one-token forward.
    per_token = {name: scale.get(name, 1.0) * (header["costs"][name]["fixed"] + header["costs"][name]["per_token"])
                 / step for name in names}
    caps = [int(c) for c in args.caps.split(",")]
    if args.search:
        search(prompts, names, cost, per_token)
        return
    if args.hindsight:
        hindsight(prompts, names, cost, per_token, caps)
        return
    configs = {name: [name] for name in names}
    for size in range(2, len(names) + 1):
        configs[" + ".join(names[:size])] = names[:size]
    for cap in caps:
        print(f"draft length cap {cap}")
        for label, members in configs.items():
            tokens, seconds, rounds, widths = replay(prompts, [(m, cap) for m in members], cost, per_token)
            print(f"  {label:40s} committed/round {tokens / rounds:.2f}  width {widths / rounds:5.1f}  "
                  f"est. speedup over plain {tokens / seconds:.2f}")


if __name__ == "__main__":
    main()
