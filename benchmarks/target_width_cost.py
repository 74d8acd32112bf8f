"""The target's forward at each verify width, in several formats interleaved on the same
tokens: the GGUF file's own quantization (`gguf`: the lean forward on specdraft's kernels;
`gguf-f32-scales`: the same with its block scales held as float32, as before they were kept
in their compact forms, models/kernels/scale_forms.py),
dequantized into float32 (`float32`: packed for oneDNN), into bfloat16 as specdraft runs it
(`bfloat16`: its weights on the block kernels, float32 arithmetic) and as torch runs it
(`bfloat16-torch`: oneDNN's bfloat16 products through transformers, what `dtype =
"bfloat16"` ran before); and, over many positions of a greedy continuation, whether each row
of a verify block gives the one-token step's logits (bit for bit, and the same argmax).
With --tree, each format is also timed over a token tree of the same number of rows (three
chains from the root, as a round of three drafters gives, then its first chain kept): what
a tree round's verify costs against a chain's.

    python benchmarks/target_width_cost.py --pool profiles/demo.toml --widths 1,2,3,4,5,6,7,8,9,10,11 \
        --positions 2000 [--formats gguf,gguf-f32-scales,float32,bfloat16,bfloat16-torch] [--tree]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from forward_timing import interleaved_costs  # benchmarks/, the folder the script runs from
from specdraft.profile import load_profile
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels import block_linear
from specdraft.models.kernels.block_linear import runs_on_file_quantization
from specdraft.models.file_quantization import weight_bytes
from specdraft.models.lean.decoder import LeanDecoder
from specdraft.models.lean.support import lean_problem
from specdraft.models.loading import load_model
from specdraft.models.kernels.packed_linear import pack_linears, packing_problem


def load(profile, form: str):
    """The target in `form` (module docstring) and whether it runs the lean forward."""
    on_file = form.startswith("gguf")
    dtype = "auto" if on_file else {"float32": "float32"}.get(form, "bfloat16")
    spec = dataclasses.replace(profile.target, quantization="gguf" if on_file else "none",
                               dtype="float32" if form == "bfloat16-torch" else dtype)
    began = time.perf_counter()
    block_linear.COMPACT_SCALES = form != "gguf-f32-scales"
    try:
        target = load_model(spec, str(profile.file), "target")
        if runs_on_file_quantization(target.model) and lean_problem(target.model) is None:
            LeanDecoder(target.model)  # its fused projections are built here, under the same setting
    finally:
        block_linear.COMPACT_SCALES = True
    if form == "bfloat16-torch":
        target.model.to(torch.bfloat16)
    seconds = time.perf_counter() - began
    lean = runs_on_file_quantization(target.model)
    if not lean and packing_problem(target.model) is None:
        pack_linears(target.model)
    print(f"{form}: loaded in {seconds:.1f} s, {weight_bytes(target.model) / 1e6:.0f} MB of weights")
    return target, lean


def invariance(model, lean: bool, prompt: torch.Tensor, positions: int) -> tuple[int, int]:
    """(rows bit-for-bit equal, rows with the same argmax) of verify blocks of widths 2..11
    against one-token steps, along the greedy continuation of `prompt`."""
    steps = CachedLM(model, lean=lean)
    logits = steps.feed(prompt)
    produced, rows = [], []
    for _ in range(positions):
        token = int(logits[-1].argmax())
        produced.append(token)
        rows.append(logits[-1])
        logits = steps.feed(torch.tensor([token]))
    one_token = torch.stack(rows)
    blocks = CachedLM(model, lean=lean)
    blocks.feed(prompt[:-1])
    fed = torch.cat([prompt[-1:], torch.tensor(produced)])
    equal = same = 0
    position, width = 0, 2
    while position < positions:
        got = blocks.feed(fed[position:position + width], keep=0)
        count = min(width, positions - position)
        equal += sum(torch.equal(got[i], one_token[position + i]) for i in range(count))
        same += int((got[:count].argmax(-1) == one_token[position:position + count].argmax(-1)).sum())
        position += width
        width = 2 + (width - 1) % 10
    return equal, same


def three_chains(rows: int) -> list[int]:
    """Parent rows of a tree of `rows` rows: the root, then three chains from it in turn."""
    parents, tips = [-1], [0, 0, 0]
    for row in range(1, rows):
        chain = (row - 1) % 3
        parents.append(tips[chain])
        tips[chain] = row
    return parents


def feed_tree(lm: CachedLM, tokens: torch.Tensor) -> None:
    parents = three_chains(tokens.shape[0])
    lm.feed_tree(tokens, parents)
    lm.keep_path([row for row in range(len(parents)) if row == 0 or (row - 1) % 3 == 0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9,10,11")
    parser.add_argument("--context", type=int, default=200, help="tokens cached before each timed forward")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--positions", type=int, default=2000, help="positions checked for invariance (0: skip)")
    parser.add_argument("--formats", default="gguf,float32",
                        help="gguf, gguf-f32-scales, float32, bfloat16, bfloat16-torch")
    parser.add_argument("--tree", action="store_true", help="also time a token tree's verify at each size")
    args = parser.parse_args()
    profile = load_profile(args.pool)
    loaded = {form: load(profile, form) for form in args.formats.split(",")}
    models = {form: (target.model, lean) for form, (target, lean) in loaded.items()}
    tokenizer = next(iter(loaded.values()))[0].tokenizer
    vocab = int(next(iter(models.values()))[0].config.vocab_size)
    widths = [int(w) for w in args.widths.split(",")]
    configs = {name: (CachedLM(model, lean=is_lean), None) for name, (model, is_lean) in models.items()}
    if args.tree:
        configs |= {f"{name} tree": (lm, None, feed_tree) for name, (lm, _) in list(configs.items())}
    costs = interleaved_costs(configs, widths, args.context, args.repeats, vocab)
    base = min(widths)  # (1 unless the widths leave it out)
    print(f"\nforward ms by width (median of {args.repeats}, after {args.context} cached tokens); x = / width "
          f"{base} (of the chain)")
    print("width  " + "  ".join(f"{name:>16s}" for name in configs))
    for width in widths:
        cells = [f"{costs[(name, width)] * 1e3:8.2f} ({costs[(name, width)] / costs[(name.split()[0], base)]:4.2f}x)"
                 for name in configs]
        print(f"{width:5d}  " + "  ".join(f"{cell:>16s}" for cell in cells))
    if args.positions:
        prompt = tokenizer("Complete this Python function:\n\ndef merge_sort(items):\n",
                                     return_tensors="pt").input_ids[0]
        for name, (model, is_lean) in models.items():
            equal, same = invariance(model, is_lean, prompt, args.positions)
            print(f"{name}: {equal}/{args.positions} verify rows bit-for-bit equal to one-token steps, "
                  f"{same}/{args.positions} with the same argmax")


if __name__ == "__main__":
    main()
