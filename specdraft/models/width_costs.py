"""What one forward of a model costs by width (tokens fed at once): measured once per model
shape, weight format, device and thread count, and kept on disk.

The verify of a round is one target forward over K + 1 tokens, and its cost is not a line
in K: BLAS libraries switch kernels by matrix shape, so a wider forward can cost less than a
narrower one (ARCHITECTURE.md, "Goodput", has a measured example); on GPUs, tensor-core
tiles make similar steps. The round cost model (`learning/goodput.py` `VerifyCosts`) plans
draft lengths with this curve and the engine pads a verify to any wider width that is
cheaper. Timings depend on shapes, not on weight values, so the key ignores the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch

from specdraft.models.kernels.block_linear import runs_on_file_quantization
from specdraft.models.cached_lm import CachedLM
from specdraft.models.kernels.native import kernel_version
from specdraft.storage.atomic_files import write_text
from specdraft.storage.cache_root import cache_dir
from specdraft.storage.regular_files import read_regular_text

log = logging.getLogger("specdraft")

PROBE_CONTEXT = 128  # tokens in the cache while widths are timed: a typical prompt's length
PROBE_REPEATS = 3  # the fastest of these per width (noise on a shared machine only adds time)
ANNOUNCE_S = 3.0  # a measurement expected to take longer is said on stderr first
STORED_OFF = 1.5  # a stored curve whose one-token step is off a quick timing by more is measured again
BUSY_SPREAD = 0.25  # repeats differing by more than this (median over widths): measured while busy
# Forwards faster than this (tiny models) vary with the timer and the scheduler more than with
# load, and a planner misled about them loses microseconds: neither check applies below it.
NOISE_FLOOR_S = 0.002


def width_costs(lm: CachedLM, max_width: int, use_disk: bool = True, fresh: bool = False) -> list[float]:
    """Seconds of a forward over w = 1 .. max_width tokens of `lm` (its cache is reset),
    from the disk cache when this model shape was measured on this machine before and a
    quick timing of one width agrees with it (`fresh`: measured again regardless, as
    `calibrate costs` does). A measurement expected to take more than a few seconds is
    announced on stderr; one taken while the machine was busy is used for this run only,
    not kept."""
    file = _cache_file(lm, max_width)
    if use_disk and not fresh:
        known = _read(file, max_width)
        if known is not None:
            now = _quick_step(lm)
            if 1 / STORED_OFF <= known[0] / now <= STORED_OFF or max(known[0], now) < NOISE_FLOOR_S:
                return known
            log.warning("specdraft: the stored verify costs of this model (%.1f ms a step) disagree with a "
                        "quick timing now (%.1f ms); measuring them again", known[0] * 1e3, now * 1e3)
    samples = timed_widths(lm, max_width, announce=lambda eta: log.info(
        "measuring the target's forward cost at widths 1-%d (~%.0f s, once for this model on this machine)",
        max_width, eta))
    seconds = [min(times) for times in samples]
    if use_disk and not _steady(samples):
        log.warning("specdraft: the machine was busy while the verify costs were timed (repeats differ); "
                    "this run uses them, the next measures again")
        return seconds
    if use_disk:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            write_text(file, json.dumps({"seconds": seconds, "key": _key_parts(lm, max_width)}, indent=1))
        except OSError as exc:  # a read-only cache only costs the next run the measurement
            log.warning("specdraft: could not keep the verify costs in %s (%s)", file, exc)
    return seconds


def stored(lm: CachedLM, max_width: int) -> tuple[Path, list[float] | None]:
    """The file this model's curve is kept in, and the curve it holds (None: none)."""
    file = _cache_file(lm, max_width)
    return file, _read(file, max_width)


def known(lm: CachedLM, max_width: int) -> bool:
    """Whether this model shape was measured on this machine before."""
    return stored(lm, max_width)[1] is not None


def measure_width_costs(lm: CachedLM, max_width: int, context: int = PROBE_CONTEXT,
                        repeats: int = PROBE_REPEATS, announce: Callable[[float], None] | None = None) -> list[float]:
    """The fastest of `repeats` timings of a forward over 1 .. max_width tokens (timed_widths)."""
    return [min(times) for times in timed_widths(lm, max_width, context, repeats, announce)]


def _steady(samples: list[list[float]]) -> bool:
    """Whether repeated timings agree: on a busy machine the repeats of most widths differ
    by more than BUSY_SPREAD, and the fastest of them is not the machine's own speed."""
    if min(min(times) for times in samples) < NOISE_FLOOR_S:
        return True
    spreads = sorted(sorted(times)[1] / sorted(times)[0] - 1 for times in samples if len(times) > 1)
    return not spreads or spreads[len(spreads) // 2] <= BUSY_SPREAD


def _quick_step(lm: CachedLM, context: int = 8, repeats: int = 3) -> float:
    """The median seconds of a one-token forward after `context` tokens, timed as the curve
    it checks was (timed_widths): a few milliseconds to a few tenths of a second."""
    return statistics.median(timed_widths(lm, 1, context, repeats)[0])


@torch.inference_mode()
def timed_widths(lm: CachedLM, max_width: int, context: int = PROBE_CONTEXT, repeats: int = PROBE_REPEATS,
                 announce: Callable[[float], None] | None = None) -> list[list[float]]:
    """Every timing of forwards over 1 .. max_width tokens after `context` cached tokens
    (`repeats` per width), widths interleaved across repeats so that drift on a shared
    machine touches all of them. `announce(estimated seconds)` is called first when that
    estimate exceeds ANNOUNCE_S."""
    vocab = int(lm.model.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    filler = torch.randint(0, vocab, (context + max_width,), generator=generator).to(lm.device)
    lm.reset()
    lm.feed(filler[:context], keep=1)
    start = lm.clock()
    lm.feed(filler[context : context + max_width], keep=0)  # the widest: an upper bound per forward
    lm.crop(context)
    estimate = (lm.clock() - start) * max_width * (repeats + 1) * 0.6  # costs rise with width, roughly
    if announce is not None and estimate > ANNOUNCE_S:
        announce(estimate)
    samples: list[list[float]] = [[] for _ in range(max_width)]
    for repeat in range(repeats + 1):  # the first pass warms allocations and kernels up
        for width in range(1, max_width + 1):
            start = lm.clock()
            lm.feed(filler[context : context + width], keep=0)
            elapsed = lm.clock() - start
            lm.crop(context)
            if repeat:
                samples[width - 1].append(elapsed)
    lm.reset()
    return samples


def _key_parts(lm: CachedLM, max_width: int) -> dict:
    model = lm.model
    parameter = next(model.parameters())
    device = lm.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where the model was read from: one shape, one key
    return {
        "config": json.dumps(config, sort_keys=True, default=str),
        "dtype": str(parameter.dtype),
        "modules": sorted({type(m).__name__ for m in model.modules()}),  # quantized linears differ
        "device": f"{device.type}:{device_name}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "widths": max_width,
        "context": PROBE_CONTEXT,
        # a model on specdraft's own kernels costs what that build of them costs
        "kernels": kernel_version() if runs_on_file_quantization(model) else None,
    }


def _cache_file(lm: CachedLM, max_width: int) -> Path:
    digest = hashlib.sha256(json.dumps(_key_parts(lm, max_width), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "width-costs" / f"{type(lm.model).__name__}-{digest}.json"


def _read(file: Path, max_width: int) -> list[float] | None:
    try:
        seconds = json.loads(read_regular_text(file, limit=1 << 20))["seconds"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if (isinstance(seconds, list) and len(seconds) == max_width
            and all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in seconds)):
        return [float(s) for s in seconds]
    return None
