"""Calls into transformers and huggingface_hub that leave no state behind: offline when asked
(no request, no retry, no wait), torch's default dtype as it was, patched attributes restored."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def from_pretrained(location: str, dtype: torch.dtype, kwargs: dict, **extra: Any) -> tuple[Any, Any]:
    """(tokenizer, model) from a folder or hub id; `kwargs` go to the model, the tokenizer
    gets the ones it shares (trust_remote_code, local_files_only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_kwargs = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "local_files_only")}
    tokenizer = AutoTokenizer.from_pretrained(location, **tokenizer_kwargs, **extra)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs, **extra)
    return tokenizer, model


@contextlib.contextmanager
def default_dtype_kept() -> Iterator[None]:
    """transformers sets torch's default dtype while it builds a model and, on some
    paths (a GGUF file loaded as float64), leaves it set: modules made later (a draft
    head) would silently be float64."""
    default = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(default)


@contextlib.contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; its module constant is what
    every request checks, so that is what is set (and restored) around a load."""
    if not offline:
        yield
        return
    import huggingface_hub.constants as constants

    with patched(constants, "HF_HUB_OFFLINE", True):
        yield


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` within the block, and what it was after."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def first_line(exc: BaseException) -> str:
    """An exception's message as one line (its type's name when it has none)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
