"""The file-quantized target's forward at each verify width with its decoder layers in one C
call and layer by layer from Python (`LeanDecoder.whole_layers_in_c`), the two interleaved on
the same tokens and cache (they give the same logits bit for bit; tests check that).

    python benchmarks/layers_in_c.py --pool profiles/demo.toml --repeats 15
"""

from __future__ import annotations

import argparse
from forward_timing import interleaved_costs  # benchmarks/, the folder the script runs from
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
    lm = CachedLM(target.model, lean=True)

    def path(in_c: bool):
        def switch() -> None:
            lm.lean.whole_layers_in_c = in_c
        return lm, switch

    costs = interleaved_costs({"one call": path(True), "layer by layer": path(False)}, widths, args.context,
                              args.repeats, int(target.model.config.vocab_size))
    print(f"forward ms by width (median of {args.repeats}, after {args.context} cached tokens)")
    for width in widths:
        one, each = (costs[(name, width)] * 1e3 for name in ("one call", "layer by layer"))
        print(f"width {width:2d}: one C call {one:6.2f}, layer by layer {each:6.2f}, ratio {one / each:.2f}")


if __name__ == "__main__":
    main()
