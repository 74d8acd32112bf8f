#!/usr/bin/env python3
"""Why a dtype is fast or slow for decoding on this CPU: one token through a decoder
layer's projections is a matrix-vector product, bound by how fast the weights stream from
memory. Measures the machine's memory bandwidth (a sum over 512 MB) and, for weights too
large for the caches (20 distinct matrices cycled), the time and effective bandwidth of a
one-row product in float32, bfloat16, weight-only int8 and int4 (specdraft's quantized
layers), at 1 and at 8 rows (a verify of 8 tokens).

    python benchmarks/cpu_kernels.py [--rows 1,8] [--shape 576x1536]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from specdraft.models.kernels.quantize import Int4Linear, Int8Linear


def seconds(calls, repeats: int = 10) -> float:
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / repeats / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--shape", default="576x1536", help="in x out (SmolLM2-135M's MLP up projection)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    inner, outer = (int(x) for x in args.shape.split("x"))
    big = torch.randn(128 * 1024 * 1024)
    bandwidth = big.numel() * 4 / seconds([big.sum], 5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, memory bandwidth (sum over 512 MB): "
          f"{bandwidth / 1e9:.1f} GB/s\n")
    layers = [nn.Linear(inner, outer, bias=False) for _ in range(20)]
    variants = {
        "float32": ([layer for layer in layers], torch.float32, 4.0),
        "bfloat16": ([nn.Linear(inner, outer, bias=False).to(torch.bfloat16) for _ in layers], torch.bfloat16, 2.0),
        "int8 (weight-only)": ([Int8Linear(layer) for layer in layers], torch.float32, 1.0),
        "int4 (weight-only)": ([Int4Linear(layer) for layer in layers], torch.float32, 0.5),
    }
    print(f"| weights | rows | ms per {inner}x{outer} product | effective GB/s | vs float32 |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        base = None
        for name, (modules, dtype, bytes_per_weight) in variants.items():
            x = torch.randn(rows, inner).to(dtype)
            took = seconds([lambda m=m: m(x) for m in modules])
            base = base or took
            print(f"| {name} | {rows} | {took * 1e3:.3f} | {inner * outer * bytes_per_weight / took / 1e9:.1f} | "
                  f"{base / took:.2f}x |")


if __name__ == "__main__":
    main()
