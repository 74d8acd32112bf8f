"""The file-quantized target's forward by width and context on this checkout's C kernels
against another revision's, interleaved in one process (the same model, the same KV buffer,
the order shuffled per repeat): what a kernel change did, free of the drift between runs.

The other revision's sources (`git show REV:specdraft/models/kernels/...`, or
`specdraft/models/...` before the kernels had a folder) are compiled as `models/kernels/native.py`
compiles this checkout's library for the instruction set this process runs (SPECDRAFT_KERNEL_ISA;
a revision from before one library per instruction set is switched to it); only the C library
differs between the two columns
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
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdraft.models.kernels import block_linear
from specdraft.models.kernels import native
from specdraft.models.kernels import native_layers
from specdraft.models.kernels.boundary import declare
from specdraft.models.cached_lm import CachedLM
from specdraft.models.loading import load_model
from specdraft.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


# Interfaces whose functions take the same arguments: 6 added the statuses of the norms and
# SwiGLU (void before) and fixed each library's instruction set (kernel_isa took a switch).
SAME_ARGUMENTS = {5, 6}


def build_revision(revision: str, folder: Path):
    """The kernel library of `revision`, for this process's instruction set, compiled into
    `folder` and loaded."""
    isa = native.kernel_isa()
    listed = subprocess.run(["git", "ls-tree", "--name-only", revision, "specdraft/models/kernels/",
                             "specdraft/models/"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    names = {}
    for name in listed:
        if re.fullmatch(r".*/cpu_[a-z0-9_]+\.[ch]", name):
            shown = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=ROOT, capture_output=True, check=True)
            (folder / Path(name).name).write_bytes(shown.stdout)
            names[Path(name).name] = folder / Path(name).name
    if "cpu_boundary.c" in names:  # one library per instruction set: this one's sources
        sources = [names[path.name] for path in native.sources(isa) if path.name in names]
    elif isa == "scalar":
        raise SystemExit(f"{revision} has no scalar kernels to compare")
    else:
        sources = [path for name, path in sorted(names.items()) if name.endswith(".c")]
    target = folder / "kernels.so"
    native._build(native.c_compiler(), target, sources, isa)  # as the package builds its own
    loaded = ctypes.CDLL(str(target))
    theirs, ours = native.interface_of(loaded), native.interface_of(native.library())
    if theirs != ours and not {theirs, ours} <= SAME_ARGUMENTS:  # this checkout's Python would call it wrongly
        raise SystemExit(f"{revision}'s kernels take other arguments (interface {theirs}, this checkout's "
                         f"{ours}): compare revisions of the same interface")
    library = declare(loaded)
    if theirs < 6:  # a switch then, and no statuses from these
        library.kernel_isa.argtypes = [ctypes.c_int]
        library.kernel_isa(int(isa == "vnni"))
        for name in ("rms_norm_rows", "add_rms_norm_rows", "swiglu_rows"):
            getattr(library, name).restype = None
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
