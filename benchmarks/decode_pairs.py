"""The one-token decode step against llama.cpp's `llama-bench` tg64 on the same file, in
alternating pairs: this VM's memory bandwidth moves by 1.5x within minutes, so a ratio means
something only between runs seconds apart. Each round runs `llama-bench -t 2 -p 0 -n 64`
(tokens/s, llama.cpp's own average over three repetitions), then a fresh specdraft process
that loads the file and times what tg64 times: 64 one-token steps of the lean forward from an
empty context (the output head on the one row, as a decode step computes it), averaged over
three passes the same way (tokens over time, per pass). The order within a pair alternates
between rounds.

    python benchmarks/decode_pairs.py /work/models/shape-qwen3-1.7b-q4_k_m.gguf ... \
        --llama-bench PATH/llama-bench [--rounds 5]

Prints each pair's ratio and, per file, the median ratio over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from load_scale import child_result, llama_bench  # benchmarks/, the folder the script runs from

STEPS = 64
CHILD = r"""
import sys, time
from pathlib import Path
import torch
from specdraft.config.model_spec import ModelSpec
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.loading import load_model

torch.set_grad_enabled(False)
model = load_model(ModelSpec(path=Path(sys.argv[1])), "p.toml", "target").model
decoder = LeanDecoder(model)
steps = int(sys.argv[2])
ids = torch.randint(0, int(model.config.vocab_size), (steps,))
decoder.forward(ids[:1], 0, 1)  # (a warm-up step: the first call builds the layer table)
rates = []
for _ in range(3):
    began = time.perf_counter()
    for i in range(steps):
        decoder.forward(ids[i:i + 1], i, 1)
    rates.append(steps / (time.perf_counter() - began))
print(f"RESULT {sum(rates) / len(rates)}")
"""


def specdraft_rate(path: Path) -> float:
    """specdraft's decode rate (tokens/s) over STEPS steps from an empty context, in a fresh process."""
    return float(child_result(CHILD, path, [str(STEPS)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    summary = []
    for path in args.files:
        ratios = []
        for round_ in range(args.rounds):
            if round_ % 2:
                ours, theirs = specdraft_rate(path), llama_bench(args.llama_bench, path, 3)
            else:
                theirs, ours = llama_bench(args.llama_bench, path, 3), specdraft_rate(path)
            ratios.append(ours / theirs)
            print(f"{path.name} round {round_ + 1}: specdraft {ours:.2f} tok/s, llama.cpp tg{STEPS} {theirs:.2f} "
                  f"tok/s, ratio {ratios[-1]:.3f}", flush=True)
        summary.append((path.name, ratios))
    print("\n| file | ratios, pair by pair | median |\n|---|---|---|")
    for name, ratios in summary:
        print(f"| {name} | {' / '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()
