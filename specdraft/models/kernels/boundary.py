"""The Python side of the kernels' safe boundary (cpu_boundary.c is the C side): the C
functions' signatures for ctypes, the check that a build's structs are the ones Python fills,
the statuses every exported function returns named in the error they raise, and the checks a
tensor passes before its address goes to C (on the CPU, of the dtype C reads, contiguous, of
the shape the call implies), so that a wrong argument is a ValueError naming the function and
the problem, never a crash or a write past a buffer."""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from specdraft.models.kernels import structs
from specdraft.models.kernels.build import KernelBuildError

NO_MEMORY, ROW_OUTSIDE, NOT_HALF = -1, -10, -13  # (statuses a caller handles itself; cpu_kernels_shared.h)
PROBLEMS = {
    -2: "a pointer it reads or writes is NULL",
    -3: "a size, count or thread count is not positive",
    -4: f"an input width is not a multiple of {structs.GROUP}",
    -5: "the bits, scale form or group count are not a layout the products read",
    -6: f"the head size is not a multiple of {structs.HEAD_LANES} or is over {structs.MAX_HEAD_DIM}",
    -7: "the query heads are not a multiple of the key/value heads",
    -8: "start is negative, or start + n is past the KV capacity",
    -9: "a token tree row's parent is not an earlier row",
    -10: "a row id is outside 0 .. N - 1",
    -11: "a layer's projection widths do not fit its heads and hidden size",
    -12: "the tensor's type is not one the C repack reads",
    -13: "a value cannot be held exactly in float16 scales",
    -14: "a size, form, activation, window or rotary table the call does not take",
}


def check_status(function: str, status: int, what: str = "") -> None:
    """Nothing for 0 (or None: an older build's function without a status, compared by a
    benchmark); else the error a C function's status means, naming the function (and `what` it
    was asked to do, when given)."""
    if not status:
        return
    if status == NO_MEMORY:
        raise MemoryError(f"{function}: {what}the kernel could not allocate its scratch memory")
    raise ValueError(f"{function}: {what}{PROBLEMS.get(status, f'status {status}')}")


def address(function: str, name: str, tensor: torch.Tensor, shape: Sequence[int | None] | None = None,
            dtype: torch.dtype = torch.float32) -> int:
    """`tensor`'s data address for C, once it is a non-empty CPU tensor of `dtype`, contiguous
    and of `shape` (None: any size in that dimension; no shape: any)."""
    problem = None
    if not isinstance(tensor, torch.Tensor):
        problem = f"is a {type(tensor).__name__}, not a tensor"
    elif tensor.device.type != "cpu":
        problem = f"is on {tensor.device}, not the CPU"
    elif tensor.dtype != dtype:
        problem = f"is {tensor.dtype}, not {dtype}"
    elif shape is not None and (tensor.dim() != len(shape)
                                or any(want is not None and got != want for got, want in zip(tensor.shape, shape))):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        problem = f"has shape {tuple(tensor.shape)}, not ({wanted})"
    elif not tensor.is_contiguous():
        problem = "is not contiguous"
    elif tensor.numel() == 0:
        problem = "is empty"
    if problem is not None:
        raise ValueError(f"{function}: {name} {problem}")
    return tensor.data_ptr()


def check_layout(loaded: ctypes.CDLL) -> None:
    """A KernelBuildError unless the build's constants and struct layouts (`kernel_layout`)
    are the ones structs.py and its ctypes mirrors hold."""
    count = loaded.kernel_layout(None, 0)
    values = (ctypes.c_int64 * max(count, 0))()
    if count <= 0 or loaded.kernel_layout(values, count) != count:
        raise KernelBuildError("the kernel build gives no layout of its structs")
    ours = structs.layout()
    if list(values) != ours:
        raise KernelBuildError(f"the kernel build's constants and struct layout {list(values)} differ from the "
                               f"ctypes mirrors in models/kernels/structs.py {ours}: rebuild with matching sources")


def declare(loaded: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' C signatures, so ctypes passes each argument as the C side reads it; every
    function returns an int (a status, a count or a layout's bits)."""
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {
        "kernel_interface": [], "kernel_isa": [], "isa_supported": [],
        "kernel_layout": [pointer, integer],
        "block_matmul": [pointer, integer, integer, pointer, pointer, pointer, integer, integer, integer, integer,
                         integer, pointer, integer],
        "block_rows": [pointer, pointer, pointer, integer, integer, integer, integer, integer, pointer, integer,
                       pointer],
        "causal_attention": [pointer, pointer, pointer, integer, integer, integer, integer, integer, integer, real,
                             pointer, integer, pointer, integer],
        "rms_norm_rows": [pointer, pointer, integer, integer, real, pointer],
        "add_rms_norm_rows": [pointer, pointer, pointer, integer, integer, real, pointer],
        "swiglu_rows": [pointer, integer, integer, pointer], "geglu_rows": [pointer, integer, integer, pointer],
        "decoder_layers": [pointer, integer, integer, integer, pointer, integer, integer, integer, integer, pointer,
                           pointer, integer, pointer, pointer, integer, real, pointer, integer],
        "attention_block": [pointer, integer, integer, integer, integer, integer, pointer, pointer, real, pointer,
                            pointer, pointer, pointer, integer, real, pointer, integer, pointer, integer],
        "expert_mlp": [pointer, integer, integer, pointer, integer, pointer, integer],
        "repack_terms": [integer], "repack_bits": [integer],
        "repack_tensor": [pointer, ctypes.c_int64, integer, ctypes.c_int64, ctypes.c_int64, pointer, pointer,
                          pointer, pointer, integer, integer],
    }
    for name, arguments in signatures.items():
        if hasattr(loaded, name):  # (an older revision's build, loaded by a benchmark, lacks the newer ones)
            function = getattr(loaded, name)
            function.restype, function.argtypes = integer, arguments
    return loaded
