"""What the forward-cost benchmarks share: a forward over each width, timed for several
configurations interleaved on the same tokens after the same cached context, so a ratio
between configurations is taken within one run, as the machine drifts.

A configuration is a CachedLM and what to switch before each timed forward (a kernel choice,
a code path), and optionally how to feed the tokens (default: as a chain; a token tree's
feed, say); configurations may share one CachedLM.
"""

from __future__ import annotations

import statistics
import time

import torch



def interleaved_costs(configs: dict[str, tuple], widths: list[int],
                      context: int, repeats: int, vocab: int) -> dict[tuple[str, int], float]:
    """{(name, width): median seconds of a forward of `width` tokens after `context` cached},
    over `repeats` passes after one untimed warm-up pass."""
    tokens = torch.randint(0, vocab, (context + max(widths),), generator=torch.Generator().manual_seed(0))
    seconds: dict = {}
    with torch.inference_mode():
        for lm in {id(config[0]): config[0] for config in configs.values()}.values():
            if context:  # (context 0: each forward is a prompt's prefill)
                lm.feed(tokens[:context])
        for repeat in range(repeats + 1):
            for width in widths:
                for name, (lm, switch, *feed) in configs.items():  # the same block back to back
                    if switch is not None:
                        switch()
                    began = time.perf_counter()
                    if feed:
                        feed[0](lm, tokens[context:context + width])
                    else:
                        lm.feed(tokens[context:context + width], keep=0)
                    elapsed = time.perf_counter() - began
                    lm.crop(context)
                    if repeat:
                        seconds.setdefault((name, width), []).append(elapsed)
    return {key: statistics.median(values) for key, values in seconds.items()}
