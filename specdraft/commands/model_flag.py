"""`-m MODEL`, the option every command has beside `--pool`: the profile it runs is the
model with the built-in pool (drafters/registry.py: prompt lookup and a suffix drafter that
learns across runs), chosen by normalhedge, as a commented TOML text. `specdraft profile init
MODEL` prints the same text to start a profile from; every command given `-m` runs the
profile this text parses to.

MODEL is a .gguf file, a transformers folder, or a hub id ("org/name") resolved from the
local Hugging Face cache only. Draft heads trained for a model live in their own folder under
the cache (`heads_folder`, where `train head -m MODEL` writes by default): every complete head
there joins the built-in pool. Plain Python: no torch (the CLI imports it at start).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from specdraft.drafters.registry import built_in_pool_toml
from specdraft.errors import UsageError
from specdraft.storage.atomic_files import write_text
from specdraft.storage.cache_root import cache_dir

HEAD_CONFIG, HEAD_WEIGHTS = "head.json", "head.safetensors"  # what `train head` writes (drafters/head_model.py)
RESERVED_NAMES = ("lookup", "suffix", "none")  # the built-in pool's own drafters, and the plain arm
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_source(model: str) -> tuple[str, str]:
    """("path", absolute path) or ("hub", id) of `model`; UsageError when it is neither an
    existing file or folder nor shaped like a hub id."""
    if not model.strip():
        raise UsageError("-m/--model: empty; give a .gguf file, a model folder or a hub id (org/name)")
    path = Path(model).expanduser()
    if path.exists():
        if not (path.is_file() or path.is_dir()):
            raise UsageError(f"-m {model}: neither a regular file nor a folder")
        return "path", str(path.resolve())
    if _HUB_ID.fullmatch(model) and not model.endswith((".gguf", ".safetensors", ".toml")):
        return "hub", model
    raise UsageError(f"-m {model}: no such file or folder (nor a hub id such as org/name)")


def heads_folder(model: str) -> Path:
    """Where the draft heads trained for `model` live: one folder per model (its name and a
    digest of its absolute path or hub id), one subfolder per head."""
    kind, value = model_source(model)
    stem = re.sub(r"[^\w.-]+", "-", Path(value).name or "model")[:60]
    return cache_dir() / "heads" / f"{stem}-{hashlib.sha256(f'{kind}:{value}'.encode()).hexdigest()[:12]}"


def found_heads(model: str) -> list[tuple[str, str]]:
    """(drafter name, folder) of every complete head (weights and config) in `heads_folder`."""
    folder = heads_folder(model)
    try:
        entries = sorted(folder.iterdir())
    except OSError:  # none trained yet (or unreadable: then none found)
        return []
    heads = []
    for entry in entries:
        if (entry / HEAD_CONFIG).is_file() and (entry / HEAD_WEIGHTS).is_file():
            name = re.sub(r"[^\w.-]+", "-", entry.name)
            heads.append((f"head-{name}" if name in RESERVED_NAMES else name, str(entry)))
    return heads


def head_out(out: str | None, model: str | None) -> str:
    """`train head`'s output folder: --out, else with -m MODEL the model's heads folder's
    "head" (which -m then finds), else a usage error."""
    if out:
        return out
    if not model:
        raise UsageError("--out: the folder to write the head to (with -m MODEL it defaults to that model's heads "
                         "folder, where -m finds it)")
    return str(heads_folder(model) / "head")


def default_profile_text(model: str) -> str:
    """The built-in profile of `model`, with comments saying what each part does."""
    kind, value = model_source(model)
    source = f'path = "{_escaped(value)}"' if kind == "path" else f'hub = "{_escaped(value)}"'
    return f"""# A specdraft profile: the target model, how to decode, the drafters and the policy.
# Written by `specdraft profile init`; edit it and run it with `--pool THIS.toml`.

[target]
{source}
# dtype = "auto"           # float32 on a CPU (a .gguf runs on its own quantization there)
# device = "auto"          # cpu, cuda, cuda:N or mps

[decode]
draft_tokens = 5           # most tokens drafted per round (the planner drafts fewer when that pays)
max_new_tokens = 256       # generation budget per prompt
temperature = 0.0          # 0: greedy (output identical to plain decoding); > 0: sampling
# stop = ["###"]           # end the answer at any of these strings

[policy]
name = "normalhedge"       # learns online which drafter pays, round by round

{built_in_pool_toml(found_heads(model), str(heads_folder(model)))}"""


def model_profile(model: str) -> str:
    """The path of `model`'s built-in profile, written under the cache folder (the same
    file for the same model: what was run can be read there)."""
    text = default_profile_text(model)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]+", "-", Path(model).name or "model")[:60]
    file = cache_dir() / "profiles" / f"{stem}-{digest}.toml"
    try:
        if not file.is_file() or file.read_text(encoding="utf-8") != text:
            file.parent.mkdir(parents=True, exist_ok=True)
            write_text(file, text)
    except OSError as exc:
        raise UsageError(f"-m {model}: cannot write its profile under {file.parent}: {exc.strerror or exc}") \
            from None
    return str(file)


def profile_path(pool: str | None, model: str | None) -> str:
    """The profile a command runs: `--pool`'s, or `-m`'s built-in one (exactly one of them)."""
    if pool and model:
        raise UsageError("give --pool PROFILE or -m MODEL, not both (a profile names its own target)")
    if model:
        return model_profile(model)
    if not pool:
        raise UsageError("give -m MODEL (a .gguf file, a model folder or a hub id) or --pool PROFILE")
    return pool


def _escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
