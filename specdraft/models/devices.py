"""Which torch device and dtype a model spec asks for, refused when this machine lacks it."""

from __future__ import annotations

import torch

from specdraft.errors import ProfileError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


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


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: how a dtype names a cache entry's flavour."""
    return str(dtype).removeprefix("torch.")


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device` (a CUDA GPU with bf16, a CPU with
    AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
