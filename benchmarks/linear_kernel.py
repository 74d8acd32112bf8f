"""The target's forward at each decode width with torch's stock linear kernels and with the
weights packed for oneDNN (`[decode] linear_kernel`), on the same model and cache, the two
interleaved (ratios within one run); and whether both pick the same greedy token.

    python benchmarks/linear_kernel.py --pool benchmarks/qwen-coder.toml --widths 1,2,3,4,8,12,16,21
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from specdraft.profile import load_profile
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import load_model
from specdraft.models.kernels.packed_linear import pack_linears, packing_problem, stock_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--widths", default="1,2,3,4,8,12,16,21")
    parser.add_argument("--context", type=int, default=128, help="tokens cached before each timed forward")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    profile = load_profile(args.pool)
    target = load_model(profile.target, str(profile.file), "target")
    model = target.model
    problem = packing_problem(model)
    if problem:
        raise SystemExit(f"cannot pack this target: {problem}")
    start = time.perf_counter()
    count = pack_linears(model, keep_dense=True)  # dense kept: the stock kernels read them
    print(f"packed {count} linear layers in {time.perf_counter() - start:.1f} s")
    widths = [int(w) for w in args.widths.split(",")]
    lm = CachedLM(model)
    vocab = int(model.get_input_embeddings().num_embeddings)
    tokens = torch.randint(0, vocab, (args.context + max(widths),), generator=torch.Generator().manual_seed(0))
    seconds: dict[tuple[str, int], list[float]] = {}
    same = total = 0
    with torch.inference_mode():
        lm.feed(tokens[: args.context], keep=1)
        for repeat in range(args.repeats + 1):  # the first pass warms kernels up, untimed
            for width in widths:
                block = tokens[args.context : args.context + width]
                picks = {}
                for kernel in ("stock", "onednn"):  # interleaved: the same forward, back to back
                    with stock_kernels(model) if kernel == "stock" else contextlib.nullcontext():
                        began = time.perf_counter()
                        logits = lm.feed(block, keep=0)
                        elapsed = time.perf_counter() - began
                    lm.crop(args.context)
                    picks[kernel] = logits.argmax(-1)
                    if repeat:
                        seconds.setdefault((kernel, width), []).append(elapsed)
                same += int((picks["stock"] == picks["onednn"]).sum())
                total += width
    print(f"{'width':>5} {'stock ms':>9} {'onednn ms':>9} {'speedup':>8}")
    for width in widths:
        stock = statistics.median(seconds[("stock", width)])
        packed = statistics.median(seconds[("onednn", width)])
        print(f"{width:5d} {stock * 1000:9.0f} {packed * 1000:9.0f} {stock / packed:7.2f}x")
    print(f"same greedy token at {same}/{total} positions")


if __name__ == "__main__":
    main()
