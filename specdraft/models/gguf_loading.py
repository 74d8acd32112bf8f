"""Loading a .gguf model: through the conversion cache (gguf_cache.py), either dequantized
into a dtype or, on a CPU by default, on the file's own block codes (file_quantization.py).

transformers reads the file (its GGUF support dequantizes every tensor); the cached entry
then loads in seconds. When the cache cannot be written the model is read straight from the
file on every load; a cached entry that still fails to load is rebuilt once.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import ProfileError
from specdraft.models import gguf_cache
from specdraft.models.devices import dtype_name
from specdraft.models.hub import first_line, from_pretrained, hub_offline, patched

log = logging.getLogger("specdraft")


def converted_float(gguf: Path, file: str, key: str, dtype: torch.dtype) -> Path | None:
    """The cache entry of `gguf` dequantized into `dtype` (converted first when needed), or
    None when the cache cannot be written."""
    return gguf_cache.converted_gguf(gguf, file, key, read_gguf, dtype_name(dtype))


def load_gguf(gguf: Path, dtype: torch.dtype, kwargs: dict, file: str, key: str) -> tuple[Any, Any]:
    """(tokenizer, model) dequantized into `dtype`: from the conversion cache (converting
    once); straight from the GGUF when the cache cannot be written; rebuilt once when a
    cached entry still fails to load."""
    kwargs = {**kwargs, "local_files_only": True}
    for attempt in (1, 2):
        folder = converted_float(gguf, file, key, dtype)
        try:
            with hub_offline(True):
                if folder is None:
                    tokenizer, model = from_pretrained(str(gguf.parent), dtype, kwargs, gguf_file=gguf.name)
                else:
                    tokenizer, model = from_pretrained(str(folder), dtype, kwargs)
                gguf_cache.tie_absent_head(model, gguf, file, key)  # transformers' own tying is not reliable here
                return tokenizer, model
        except Exception as exc:
            if folder is None:
                raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
            _failed_entry(gguf, folder, attempt, exc, file, key)
    raise AssertionError("unreachable")


def load_gguf_quantized(gguf: Path, file: str, key: str) -> tuple[Any, Any]:
    """(tokenizer, model) on the file's own quantization, from the conversion cache (converted
    once; straight from the file, slowly, when the cache cannot be written)."""
    from transformers import AutoTokenizer

    from specdraft.models import file_quantization as fq
    from specdraft.models import quantized_entry

    def write(model: Any, source: Path, folder: Path) -> None:
        quantized_entry.save_entry(model, fq.read_file_codes(source, model), folder)

    for attempt in (1, 2):
        folder = gguf_cache.converted_gguf(gguf, file, key, lambda path, _: read_gguf(path), quantized_entry.FORMAT,
                                           write)
        if folder is None:
            model, tokenizer = read_gguf(gguf)
            gguf_cache.tie_absent_head(model, gguf, file, key)
            return tokenizer, fq.quantized_in_place(model, fq.read_file_codes(gguf, model))
        try:
            with hub_offline(True):
                tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            return tokenizer, quantized_entry.load_entry(folder)
        except Exception as exc:
            _failed_entry(gguf, folder, attempt, exc, file, key)
    raise AssertionError("unreachable")


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
    unless progress bars are wanted, since our own line already says what is happening."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    patch = contextlib.nullcontext()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None and not hf_logging.is_progress_bar_enabled():
        patch = patched(gguf_utils, "tqdm", lambda *a, **k: original(*a, **{**k, "disable": True}))
    with patch, hub_offline(True):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    return model, tokenizer
