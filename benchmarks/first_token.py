"""Start-up to the first generated token, as a user meets it: `specdraft generate` of one new
token on a GGUF file (a profile of the file and a lookup drafter under normalhedge), with an
empty cache (its first run: the config and tokenizer read, the verify costs measured) and
with the cache kept (a later run), against llama.cpp's `llama-cli -n 1 -st` on the same file.
The kernels are built once beforehand (a one-off per machine, not per model). Runs
interleave; medians of --repeats.

    python benchmarks/first_token.py /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --llama-cli PATH/llama-cli [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "def fibonacci(n):"


def timed(command: list[str], env: dict | None = None) -> float:
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-cli", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = Path(scratch) / "kernels-cache"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECDRAFT_CACHE_DIR": str(kernels)}
        subprocess.run([sys.executable, "-c", "from specdraft.models.kernels.native import library; library()"], env=env,
                       check=True)
        print("| file | llama-cli -n 1 s | specdraft first run s | later runs s | first / llama | later / llama |")
        print("|---|---|---|---|---|---|")
        for path in args.files:
            profile = Path(scratch) / f"{path.stem}.toml"
            profile.write_text(f'[target]\npath = "{path}"\n\n[decode]\nmax_new_tokens = 1\n\n'
                               '[policy]\nname = "normalhedge"\n\n[[drafters]]\nname = "lookup"\nkind = "ngram"\n')
            command = [sys.executable, "-m", "specdraft", "generate", "--pool", str(profile), "--raw", PROMPT]
            llama, first, later = [], [], []
            for repeat in range(args.repeats):
                llama.append(timed([args.llama_cli, "-m", str(path), "-p", PROMPT, "-n", "1", "-t", "2", "-st",
                                    "--simple-io"]))
                cache = Path(scratch) / f"cache-{path.stem}-{repeat}"
                shutil.copytree(kernels, cache)
                fresh = {**env, "SPECDRAFT_CACHE_DIR": str(cache)}
                first.append(timed(command, fresh))
                later.append(timed(command, fresh))
            a, b, c = statistics.median(llama), statistics.median(first), statistics.median(later)
            print(f"| {path.name} | {a:.1f} | {b:.1f} | {c:.1f} | {b / a:.1f}x | {c / a:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
