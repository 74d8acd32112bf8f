"""The file-quantized target's forward at each verify width with its decoder layers in one C
call and layer by layer from Python (`LeanDecoder.whole_layers_in_c`), the two interleaved on
the same tokens and cache (they give the same logits bit for bit; tests check that).

    python benchmarks/layers_in_c.py --pool profiles/demo.toml --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import load_model
from specdraft.profile import load_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--widths", default="1,2,4,8,11")
    parser.add_argument("--context", type=int, default=200, help="tokens cached before each timed forward")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    profile = load_profile(args.pool)
    target = load_model(profile.target, str(profile.file), "target")
    widths = [int(w) for w in args.widths.split(",")]
    tokens = torch.randint(0, int(target.model.config.vocab_size), (args.context + max(widths),),
                           generator=torch.Generator().manual_seed(0))
    lm = CachedLM(target.model, lean=True)
    seconds: dict = {}
    with torch.inference_mode():
        lm.feed(tokens[:args.context])
        for repeat in range(args.repeats + 1):  # the first pass warms up, untimed
            for width in widths:
                for in_c in (True, False):
                    lm.lean.whole_layers_in_c = in_c
                    began = time.perf_counter()
                    lm.feed(tokens[args.context:args.context + width], keep=0)
                    elapsed = time.perf_counter() - began
                    lm.crop(args.context)
                    if repeat:
                        seconds.setdefault((width, in_c), []).append(elapsed)
    print(f"forward ms by width (median of {args.repeats}, after {args.context} cached tokens)")
    for width in widths:
        one, each = (statistics.median(seconds[(width, flag)]) * 1e3 for flag in (True, False))
        print(f"width {width:2d}: one C call {one:6.2f}, layer by layer {each:6.2f}, ratio {one / each:.2f}")


if __name__ == "__main__":
    main()
