#!/usr/bin/env python3
"""How the suffix drafter's lookup cost grows with the size of what it searches.

Indexes the first N tokens of a datastore (or random text) for N = 10^5 .. all, and times
a draft (longest match + continuation, as the drafter does per round) for contexts taken
from the text itself, so every lookup finds long matches. Prints microseconds per draft
and the index build time per size.

    python benchmarks/suffix_lookup_cost.py /tmp/stdlib-store
"""

from __future__ import annotations

import sys
import time

import numpy as np

from specdraft.drafters.suffix_index import SuffixIndex, continue_occurrences


def main() -> None:
    if len(sys.argv) > 1:
        full = np.load(f"{sys.argv[1]}/text.npy", mmap_mode="r")
    else:
        full = np.random.default_rng(0).integers(0, 32000, 10_000_000).astype(np.int32)
    rng = np.random.default_rng(1)
    sizes = [n for n in (10**5, 10**6, 10**7) if n < len(full)] + [len(full)]
    print(f"{'tokens':>12}{'build s':>10}{'draft us':>10}{'matched':>9}")
    for n in sizes:
        text = np.array(full[:n])
        text[0] = -1
        started = time.perf_counter()
        index = SuffixIndex.build(text, 32)
        built = time.perf_counter() - started
        starts = rng.integers(64, 10**5 - 64, 2000)  # the same contexts at every size
        contexts = [full[s - 32:s].tolist() for s in starts]
        matched = 0
        started = time.perf_counter()
        for context in contexts:
            found = index.longest_match(context, 32)
            continue_occurrences([found], 10, 0.1)
            matched += found.length
        per = (time.perf_counter() - started) / len(contexts) * 1e6
        print(f"{n:>12,}{built:>10.1f}{per:>10.0f}{matched / len(contexts):>9.1f}")


if __name__ == "__main__":
    main()
