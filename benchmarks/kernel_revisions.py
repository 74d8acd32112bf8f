"""The file-quantized target's forward by width and context on this checkout's C kernels
against another revision's, interleaved in one process (the same model, the same KV buffer,
the order shuffled per repeat): what a kernel change did, free of the drift between runs.

The other revision's sources (`git show REV:specdraft/models/...`) are compiled as
`models/kernels/native.py` compiles this checkout's; only the C library differs between the two columns
(the decoder layers' call and the output head's block product alike), the Python around it is
this checkout's. A prompt prefill is timed as a forward of its width at
context 0.

    python benchmarks/kernel_revisions.py --pool profiles/demo.toml --against 3c556b9 \
        [--contexts 50,300,600] [--widths 1,2,4,8] [--prefill 100,300,1000] [--repeats 6]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdraft.models.kernels import block_linear
from specdraft.models.kernels import native
from specdraft.models.kernels import native_layers
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import load_model
from specdraft.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


def build_revision(revision: str, folder: Path):
    """The kernel library of `revision`, compiled into `folder` and loaded."""
    sources = []
    for path in (*native.SOURCES, native.HEADER):
        name = f"specdraft/models/{path.name}"
        shown = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=ROOT, capture_output=True)
        if shown.returncode == 0:  # (a source that revision did not have yet is left out)
            (folder / path.name).write_bytes(shown.stdout)
            if path.suffix == ".c":
                sources.append(folder / path.name)
    target = folder / "kernels.so"
    native._build(native.c_compiler(), target, sources)  # as the package builds its own
    loaded = ctypes.CDLL(str(target))
    theirs, ours = native.interface_of(loaded), native.interface_of(native.library())
    if theirs != ours:  # this checkout's Python would call it with other arguments
        raise SystemExit(f"{revision}'s kernels take other arguments (interface {theirs}, this checkout's "
                         f"{ours}): compare revisions of the same interface")
    library = native._declared(loaded)
    library.kernel_isa(native.kernel_isa())
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--against", required=True, help="the git revision whose kernels are compared")
    parser.add_argument("--contexts", default="50,300,600")
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--prefill", default="100,300,1000")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    profile = load_profile(args.pool)
    target = load_model(profile.target, str(profile.file), "target")
    contexts, widths = [int(c) for c in args.contexts.split(",")], [int(w) for w in args.widths.split(",")]
    lm = CachedLM(target.model, lean=True)
    lm.feed(torch.arange(max(contexts) + max(widths)) * 11 % 40000 + 100)  # every position a case reads, cached
    forward = lm.lean.forward
    with tempfile.TemporaryDirectory() as folder:
        libraries = {"this checkout": native.library(), args.against: build_revision(args.against, Path(folder))}
        cases = [(c, w) for c in contexts for w in widths]
        cases += [(0, n) for n in map(int, args.prefill.split(","))]
        seconds: dict[tuple, list[float]] = {}
        for _ in range(args.repeats):
            for start, width in cases:
                for name in random.sample(list(libraries), len(libraries)):
                    native_layers.library = block_linear.library = lambda chosen=libraries[name]: chosen
                    ids = (torch.arange(width) * 7 % 40000 + 100).view(1, -1)
                    reps = 1 if width > 16 else 10
                    forward(ids, start, 1)
                    began = time.perf_counter()
                    for _ in range(reps):
                        forward(ids, start, 1)
                    seconds.setdefault((start, width, name), []).append((time.perf_counter() - began) / reps)
    mine, other = libraries
    print(f"forward ms, best of {args.repeats} (x = {other} / this checkout)")
    print(f"{'context':>8} {'width':>6} {mine:>14} {other:>14}")
    for start, width in cases:
        a, b = min(seconds[(start, width, mine)]), min(seconds[(start, width, other)])
        print(f"{start:8d} {width:6d} {a * 1e3:14.2f} {b * 1e3:14.2f}  ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
