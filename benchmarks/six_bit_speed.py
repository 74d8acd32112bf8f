"""Q6_K (and Q3_K) weights on the 6-bit products against the int8 rows they were rounded to
before, on the same file in one process, forwards interleaved by width: what holding the
file's exact 6-bit codes costs or saves a step.

    python benchmarks/six_bit_speed.py /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [--repeats 7]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from forward_timing import interleaved_costs  # benchmarks/, the folder the script runs from
from specdraft.config.model_spec import ModelSpec
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.cached_lm import CachedLM
from specdraft.models.file_quantization import weight_bytes
from specdraft.models.kernels.formats import int8_rows
from specdraft.models.loading import load_model


def rounded(model: torch.nn.Module) -> int:
    """Every 6-bit layer of `model` replaced by int8 rows of its weights (the old layout)."""
    moved = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockLinear) and child.bits == 6:
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, BlockLinear.of(int8_rows(child.weight.numpy()), bias))
                moved += 1
    if hasattr(model.model.embed_tokens, "head"):
        model.model.embed_tokens.head = model.lm_head
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--widths", default="1,2,4,8")
    args = parser.parse_args()
    spec = ModelSpec(path=args.file)
    six = load_model(spec, "p.toml", "target").model
    old = load_model(spec, "p.toml", "target").model
    print(f"{rounded(old)} layers as int8 rows; weights {weight_bytes(six) / 1e6:.0f} MB (6-bit) "
          f"vs {weight_bytes(old) / 1e6:.0f} MB (int8 rows)")
    configs = {"6-bit": (CachedLM(six, lean=True), None), "int8 rows": (CachedLM(old, lean=True), None)}
    widths = [int(w) for w in args.widths.split(",")]
    costs = interleaved_costs(configs, widths, 64, args.repeats, int(six.config.vocab_size))
    print("width  6-bit ms  int8 rows ms  6-bit / int8")
    for w in widths:
        a, b = costs[("6-bit", w)], costs[("int8 rows", w)]
        print(f"{w:5d}  {a * 1e3:8.1f}  {b * 1e3:12.1f}  {a / b:12.3f}")


if __name__ == "__main__":
    main()
