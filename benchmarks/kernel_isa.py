"""The file-quantized target's forward at each verify width on specdraft's AVX2 kernels and on
its AVX-512 VNNI kernels (where the CPU has them; each its own library, native.using_isa), the
two interleaved on the same tokens and cache; and whether the two give the same logits bit for
bit over a greedy continuation (they are meant to: see cpu_kernels_vnni.c).

    python benchmarks/kernel_isa.py --pool profiles/demo.toml --widths 1,2,3,4,5,6,8,11 --positions 300
"""

from __future__ import annotations

import argparse
import torch

from forward_timing import interleaved_costs  # benchmarks/, the folder the script runs from
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import load_model
from specdraft.models.kernels.native import using_isa, vnni_available
from specdraft.profile import load_profile

ISAS = ("avx2", "vnni")


def same_logits(model, prompt: torch.Tensor, positions: int) -> tuple[int, int]:
    """(one-token steps, verify rows of widths 2..11) whose logits are bit for bit the same on
    both kernels, along the greedy continuation of `prompt`."""
    runs = {}
    for isa in ISAS:
        lm = CachedLM(model, lean=True)
        with torch.inference_mode(), using_isa(isa):
            logits, steps = lm.feed(prompt), []
            for _ in range(positions):
                steps.append(logits[-1])
                logits = lm.feed(logits[-1].argmax().view(1))
            produced = torch.stack(steps).argmax(-1)
            blocks = CachedLM(model, lean=True)
            blocks.feed(prompt[:-1])
            fed, rows, position, width = torch.cat([prompt[-1:], produced]), [], 0, 2
            while position < positions:
                rows.append(blocks.feed(fed[position:position + width], keep=0)[:positions - position])
                position += width
                width = 2 + (width - 1) % 10
        runs[isa] = (torch.stack(steps), torch.cat(rows))
    (steps_a, rows_a), (steps_b, rows_b) = runs.values()
    return (sum(torch.equal(a, b) for a, b in zip(steps_a, steps_b)),
            sum(torch.equal(a, b) for a, b in zip(rows_a, rows_b)))


def feed_on(isa: str, lm: CachedLM, tokens: torch.Tensor) -> None:
    with using_isa(isa):
        lm.feed(tokens, keep=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--widths", default="1,2,3,4,5,6,8,11")
    parser.add_argument("--context", type=int, default=200, help="tokens cached before each timed forward")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--positions", type=int, default=300, help="positions compared between the kernels (0: skip)")
    args = parser.parse_args()
    if not vnni_available():
        raise SystemExit("this CPU has no AVX-512 VNNI: only the AVX2 kernels run here")
    profile = load_profile(args.pool)
    target = load_model(profile.target, str(profile.file), "target")
    widths = [int(w) for w in args.widths.split(",")]
    lm = CachedLM(target.model, lean=True)
    costs = interleaved_costs({isa: (lm, None, lambda lm, tokens, isa=isa: feed_on(isa, lm, tokens)) for isa in ISAS},
                              widths, args.context, args.repeats, int(target.model.config.vocab_size))
    print(f"forward ms by width (median of {args.repeats}, after {args.context} cached tokens, "
          f"{torch.get_num_threads()} threads); x = / AVX2 width 1")
    print("width        avx2          vnni   vnni/avx2")
    base = costs[("avx2", 1)]
    for width in widths:
        a, v = costs[("avx2", width)], costs[("vnni", width)]
        print(f"{width:5d}  {a * 1e3:6.2f} ({a / base:4.2f}x)  {v * 1e3:6.2f} ({v / base:4.2f}x)  {v / a:6.2f}")
    if args.positions:
        prompt = target.tokenizer("Complete this Python function:\n\ndef merge_sort(items):\n",
                                  return_tensors="pt").input_ids[0]
        steps, rows = same_logits(target.model, prompt, args.positions)
        print(f"bit for bit equal on both kernels: {steps}/{args.positions} one-token steps, "
              f"{rows}/{args.positions} verify rows")


if __name__ == "__main__":
    main()
