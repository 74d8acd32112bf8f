"""Loading a .gguf model: on a CPU by default on the file's own block codes, built from the
mapped file (gguf/mapping.py) with the config and tokenizer from a small metadata entry of
the cache; or dequantized into a dtype through the conversion cache (gguf/cache.py), where
transformers reads the file (its GGUF support dequantizes every tensor) once.

When the cache cannot be written, what it would hold is read from the file on every load; a
cached entry that fails to load is rebuilt once.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from specdraft.errors import ProfileError
from specdraft.models.gguf import cache as gguf_cache
from specdraft.models.devices import dtype_name
from specdraft.models.gguf.cache import METADATA
from specdraft.models.gguf.metadata import read_config_and_tokenizer
from specdraft.models.hub import first_line, from_pretrained, hub_offline, patched

log = logging.getLogger("specdraft")

# What a command shows while a model's tensors load: called with (bytes done, bytes in all).
LOAD_PROGRESS: ContextVar[Callable[[int, int], None] | None] = ContextVar("load_progress", default=None)


def converted_float(gguf: Path, file: str, key: str, dtype: torch.dtype) -> Path | None:
    """The cache entry of `gguf` dequantized into `dtype` (converted first when needed), or
    None when the cache cannot be written."""
    def read_tied(path: Path, dtype_text: str) -> tuple[Any, Any]:
        model, tokenizer = read_gguf(path, dtype_text)
        gguf_cache.tie_absent_head(model, path, file, key)
        return model, tokenizer

    return gguf_cache.converted_gguf(gguf, file, key, read_tied, dtype_name(dtype))


def load_gguf(gguf: Path, dtype: torch.dtype, kwargs: dict, file: str, key: str) -> tuple[Any, Any]:
    """(tokenizer, model) dequantized into `dtype`: from the conversion cache (converting
    once); straight from the GGUF when the cache cannot be written; rebuilt once when a
    cached entry still fails to load."""
    kwargs = {**kwargs, "local_files_only": True}
    checked_gguf(gguf, file, key).close()
    for attempt in (1, 2):
        try:
            folder = converted_float(gguf, file, key, dtype)
        except (AssertionError, ValueError, KeyError, IndexError, TypeError, RuntimeError) as exc:
            # transformers could not build a model from the file's tensors and metadata
            raise ProfileError(file, key, f"transformers cannot build a model from {gguf.name}: "
                                          f"{first_line(exc)}") from None
        try:
            with hub_offline(True):
                if folder is None:
                    tokenizer, model = from_pretrained(str(gguf.parent), dtype, kwargs, gguf_file=gguf.name)
                else:
                    tokenizer, model = from_pretrained(str(folder), dtype, kwargs)
                # transformers' own tying is not reliable here
                gguf_cache.tie_absent_head(model, gguf, file, key,
                                           None if folder is None else gguf_cache.checkpoint_names(folder))
                return tokenizer, model
        except Exception as exc:
            if folder is None:
                raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
            _failed_entry(gguf, folder, attempt, exc, file, key)
    raise AssertionError("unreachable")


def load_gguf_mapped(gguf: Path, file: str, key: str) -> tuple[Any, Any]:
    """(tokenizer, model) on the file's own quantization, built from the mapped file
    (gguf/mapping.py). The weights are repacked on a thread of their own from the moment the
    header is read, while the config and tokenizer are read. The cache keeps only what is
    slow to derive and small: the config and the tokenizer transformers builds from the
    file's metadata (seconds for a large vocabulary); an entry of an older specdraft holding
    the repacked weights is removed."""
    from specdraft.models.gguf.file import GGUFError
    from specdraft.models.gguf.mapping import mapped_model, weights_ahead

    mapped = checked_gguf(gguf, file, key)
    try:
        ahead = weights_ahead(mapped, LOAD_PROGRESS.get())
    except GGUFError as exc:
        raise ProfileError(file, key, str(exc)) from None
    try:
        gguf_cache.remove_weight_entries(gguf)
        config, tokenizer = _config_and_tokenizer(gguf, mapped, file, key)
        try:
            return tokenizer, mapped_model(mapped, config, ahead)
        except GGUFError as exc:
            raise ProfileError(file, key, str(exc)) from None
    finally:
        ahead.cancel()  # (joined already when the model was built; else stopped, so nothing reads the mapping)


def _config_and_tokenizer(gguf: Path, mapped: Any, file: str, key: str) -> tuple[Any, Any]:
    """The config and tokenizer of `gguf`: from its metadata cache entry (written first when
    needed), rebuilt once when the entry fails to load; from the file when nothing can be
    cached."""
    for attempt in (1, 2):
        folder = gguf_cache.converted_gguf(gguf, file, key, lambda path, _: read_metadata(path, mapped), METADATA,
                                           lambda model, source, staging: None)
        try:
            if folder is None:
                with hub_offline(True):
                    return read_config_and_tokenizer(gguf, mapped)
            return _metadata(folder)
        except Exception as exc:
            if folder is None:
                raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
            _failed_entry(gguf, folder, attempt, exc, file, key)
    raise AssertionError("unreachable")


def checked_gguf(gguf: Path, file: str, key: str) -> Any:
    """`gguf`'s parsed header (a GGUFFile, mapped), checked as a model's (gguf/checks.py)
    before anything is built from it; a ProfileError (exit 2) naming the cause otherwise."""
    from specdraft.models.gguf.checks import check_model_header
    from specdraft.models.gguf.file import GGUFError, GGUFFile

    try:
        parsed = GGUFFile(gguf)
    except GGUFError as exc:
        raise ProfileError(file, key, str(exc)) from None
    try:
        check_model_header(parsed)
    except GGUFError as exc:
        parsed.close()
        raise ProfileError(file, key, str(exc)) from None
    return parsed


def read_metadata(gguf: Path, parsed: Any = None) -> tuple[Any, Any]:
    """(an object with the config and generation config, tokenizer) from the file's metadata
    alone (`parsed`: its GGUFFile, when already read): what a metadata entry saves."""
    from transformers import GenerationConfig

    with hub_offline(True):
        config, tokenizer = read_config_and_tokenizer(gguf, parsed)
    return SimpleNamespace(config=config, generation_config=GenerationConfig.from_model_config(config)), tokenizer


def _metadata(folder: Path) -> tuple[Any, Any]:
    """(config, tokenizer) of a metadata entry."""
    from transformers import AutoConfig, AutoTokenizer

    with hub_offline(True):
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return config, AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)


def _failed_entry(gguf: Path, folder: Path, attempt: int, exc: Exception, file: str, key: str) -> None:
    """A cached entry that failed to load: removed for a rebuild after a first attempt,
    a ProfileError after the second."""
    if attempt == 2:
        raise ProfileError(file, key, f"cannot load the converted {gguf.name} cached at {folder}: "
                                      f"{first_line(exc)}") from None
    log.warning("cached conversion %s failed to load (%s); rebuilding it", folder, first_line(exc))
    shutil.rmtree(folder, ignore_errors=True)


def read_gguf(gguf: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from a GGUF file into `dtype`; transformers' tqdm bar is silenced
    unless progress bars are wanted, since our own line already says what is happening. The
    config is transformers' reading of the file with what its reader leaves out set from the
    file (gguf/architectures.py: Gemma 3's attention scale, Qwen3-MoE's expert width)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specdraft.models.gguf.architectures import ARCHITECTURES
    from specdraft.models.gguf.file import GGUFFile

    patch = contextlib.nullcontext()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None and not hf_logging.is_progress_bar_enabled():
        patch = patched(gguf_utils, "tqdm", lambda *a, **k: original(*a, **{**k, "disable": True}))
    with patch, hub_offline(True):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        parsed = GGUFFile(gguf)
        try:
            if parsed.architecture in ARCHITECTURES:
                ARCHITECTURES[parsed.architecture].configure(config, parsed.field)
        finally:
            parsed.close()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=getattr(torch, dtype))
    return model, tokenizer
