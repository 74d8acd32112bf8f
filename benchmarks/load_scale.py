"""Loading and stepping a GGUF model at real sizes, against llama.cpp's own `llama-bench` on
the same file: per file, load time (cold: no cache entry; warm: the metadata entry kept), the
process's memory before loading (Python, torch, transformers), after and at its peak, the
weights held, the lean forward's one-token step and verify widths 2/4/8, and the bandwidth the
step achieves against the machine's (a 2-thread read of 2 GiB, timed here). Each load runs in a
fresh process; timings interleave specdraft and llama.cpp per file.

    python benchmarks/load_scale.py /work/models/shape-3b-q4_0.gguf /work/models/shape-8b-q4_0.gguf \
        --llama-bench PATH/llama-bench [--repeats 5] [--json out.json]

Files come from tools/make_shape_gguf.py (random weights at Llama 3's shapes) or are real.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import json, os, sys, time
began = time.perf_counter()
import torch
from pathlib import Path
from specdraft.config.model_spec import ModelSpec
from specdraft.models.loading import load_model
from specdraft.models.file_quantization import weight_bytes
imported = time.perf_counter() - began

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
began = time.perf_counter()
spec = ModelSpec(path=Path(sys.argv[1]))
target = load_model(spec, "p.toml", "target")
loaded = time.perf_counter() - began
result = {"import_s": imported, "load_s": loaded, "rss_before": before, "rss_after": status("VmRSS"),
          "rss_peak": status("VmHWM"), "weights": weight_bytes(target.model)}
if sys.argv[2] == "steps":
    sys.path.insert(0, "benchmarks")
    from forward_timing import interleaved_costs
    from specdraft.models.cached_lm import CachedLM
    lm = CachedLM(target.model, lean=True)
    widths = [1, 2, 4, 8]
    costs = interleaved_costs({"specdraft": (lm, None)}, widths, 64, int(sys.argv[3]), int(target.model.config.vocab_size))
    result["step_s"] = {w: costs[("specdraft", w)] for w in widths}
print("RESULT " + json.dumps(result))
"""


def child(path: Path, steps: bool, repeats: int, cache: str) -> dict:
    return child_result(CHILD, path, ["steps" if steps else "load", str(repeats)], {"SPECDRAFT_CACHE_DIR": cache})


def child_result(code: str, path: Path, arguments: list[str], env: dict[str, str] | None = None) -> Any:
    """What the Python `code`, run in a fresh process on `path` with `arguments` (offline, plus
    `env`), prints as JSON after "RESULT "; its last error line otherwise."""
    done = subprocess.run([sys.executable, "-c", code, str(path), *arguments], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{path.name}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(line[len("RESULT "):])


def llama_bench(binary: str, path: Path, repeats: int) -> float:
    """llama.cpp's decode rate (tokens/s, tg64, 2 threads) on the file."""
    done = subprocess.run([binary, "-m", str(path), "-t", "2", "-p", "0", "-n", "64", "-r", str(repeats), "-o", "json"],
                          capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def bandwidth() -> float:
    """GB/s of a 2-thread read of 2 GiB (the best of five)."""
    import torch

    torch.set_num_threads(2)
    data = torch.ones(1 << 29)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    machine = bandwidth()
    rows = []
    for path in args.files:
        with tempfile.TemporaryDirectory() as cache:
            cold = child(path, False, args.repeats, cache)
            warm = child(path, True, args.repeats, cache)
        rate = llama_bench(args.llama_bench, path, args.repeats)
        rows.append({"file": path.name, "bytes": path.stat().st_size, "cold": cold, "warm": warm, "llama_tg": rate})
        print(f"{path.name}: done", file=sys.stderr)
    print(f"machine read bandwidth (2 threads): {machine:.1f} GB/s\n")
    print("| file | GB | load cold / warm s | RSS before / after / peak GB | weights / file | "
          "step ms w1 / w2 / w4 / w8 | tok/s vs llama.cpp tg64 | step GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cold, warm, size = row["cold"], row["warm"], row["bytes"]
        steps = warm["step_s"]
        rate = 1 / steps["1"] if "1" in steps else 1 / steps[1]
        ms = " / ".join(f"{steps[k] * 1e3:.1f}" for k in steps)
        print(f"| {row['file']} | {size / 1e9:.2f} | {cold['load_s']:.1f} / {warm['load_s']:.1f} | "
              f"{warm['rss_before'] / 1e9:.2f} / {warm['rss_after'] / 1e9:.2f} / {warm['rss_peak'] / 1e9:.2f} | "
              f"{warm['weights'] / size:.2f}x | {ms} | {rate:.1f} vs {row['llama_tg']:.1f} ({rate / row['llama_tg']:.2f}x) "
              f"| {warm['weights'] * rate / 1e9:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
