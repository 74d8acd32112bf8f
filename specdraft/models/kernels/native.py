"""specdraft's own CPU kernels (cpu_kernels.c and the files beside it), built on first use and
loaded with ctypes, one library per instruction set:

- `vnni`: the block products on AVX-512 VNNI (cpu_kernels_vnni.c), the rest on AVX2;
- `avx2`: AVX2 with FMA and F16C (every x86 CPU of the last ten years);
- `neon`: AArch64 NEON, with the dot-product instruction where the CPU has it
  (cpu_kernels_neon.c, cpu_attention_neon.c);
- `scalar`: plain C, no intrinsics (cpu_kernels_scalar.c, cpu_attention_scalar.c), built
  without any -m flag, so it runs on any CPU; also the reference the tests hold the others to.

(kernels/targets.py: which CPU runs which, and each one's compiler flags.) All four give the same numbers bit for bit; the choice changes only speed. The process takes
the fastest its CPU runs (SPECDRAFT_KERNEL_ISA=auto) or the one SPECDRAFT_KERNEL_ISA names
(one this CPU cannot run is a usage error), once; each library's instruction set is fixed
when it is compiled (no switch to flip), and `using_isa` runs a block of code on another
library (tests and benchmarks compare them). The C files need no torch headers: the machine's
C compiler builds each library in seconds, keyed by its sources, flags and compiler;
kernels/build.py builds, records and checks each build before it is loaded. Without a
compiler `kernel_problem` says why, and callers keep torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specdraft.errors import UsageError
from specdraft.models.kernels.boundary import address, check_layout, check_status, declare
from specdraft.models.kernels.build import KernelBuildError, compiler_command, compiler_version, load_library
from specdraft.models.kernels.targets import (COMMON, HEADER_NAMES, ISA_CHOICES, ISA_SOURCES, ISAS, NEEDS,
                                              fastest_available, flags, isa_available)

HERE = Path(__file__).parent
HEADERS = tuple(HERE / name for name in HEADER_NAMES)
FLAGS = flags("avx2")  # (the vector builds' flags, as before one library per instruction set)
_SELECTED: ContextVar[str | None] = ContextVar("specdraft_kernel_isa", default=None)  # `using_isa`
_LOADED: set[str] = set()  # the instruction sets whose library this process loaded


def sources(isa: str) -> tuple[Path, ...]:
    """The C files of `isa`'s library."""
    return tuple(HERE / name for name in (*ISA_SOURCES[isa], *COMMON))


@functools.lru_cache(maxsize=1)
def kernel_problem() -> str | None:
    """Why the kernels cannot run here, or None when they can (asked once per process: a
    failed build is not retried by every model load and lean forward). With
    SPECDRAFT_REQUIRE_KERNELS=1 (CI) a problem is an error instead."""
    try:
        library()
    except KernelBuildError as exc:
        if os.environ.get("SPECDRAFT_REQUIRE_KERNELS") == "1":
            raise KernelBuildError(f"SPECDRAFT_REQUIRE_KERNELS=1 but the kernels cannot run: {exc}") from None
        return str(exc)
    return None


@functools.lru_cache(maxsize=1)
def process_isa() -> str:
    """The instruction set this process runs (SPECDRAFT_KERNEL_ISA, read once; auto: the
    fastest this CPU has)."""
    chosen = os.environ.get("SPECDRAFT_KERNEL_ISA", "auto")
    if chosen not in ISA_CHOICES:
        raise UsageError(f"SPECDRAFT_KERNEL_ISA={chosen}: expected one of {', '.join(ISA_CHOICES)}")
    if chosen == "auto":
        return fastest_available()
    if not isa_available(chosen):
        raise UsageError(f"SPECDRAFT_KERNEL_ISA={chosen}: this CPU has no {NEEDS[chosen]} (use auto or scalar)")
    return chosen


def kernel_isa() -> str:
    """The instruction set the kernels run on here and now: "scalar", "avx2", "vnni" or "neon"."""
    return _SELECTED.get() or process_isa()


def library(isa: str | None = None) -> ctypes.CDLL:
    """The built kernels of `isa` (None: `kernel_isa()`), loaded (built first where these
    sources, compiler and flags never were; kernels/build.py checks that a build is ours)."""
    return _loaded(isa or _SELECTED.get() or process_isa())


@functools.lru_cache(maxsize=None)
def _loaded(isa: str) -> ctypes.CDLL:
    if isa not in ISAS:
        raise ValueError(f"no kernels for instruction set {isa!r}: expected one of {', '.join(ISAS)}")
    if not isa_available(isa):
        raise KernelBuildError(f"this CPU cannot run the {isa} kernels")
    command = compiler_command()
    version = compiler_version(command)
    files = sources(isa)
    code = b"".join(path.read_bytes() for path in (*files, *HEADERS))
    digest = hashlib.sha256(code + version.encode() + " ".join(flags(isa)).encode()).hexdigest()[:16]
    loaded = declare(load_library(f"cpu_kernels-{isa}", files, flags(isa), digest))
    loaded.build_id, loaded.isa = digest, isa
    check_layout(loaded)
    if loaded.kernel_isa() != ISAS.index(isa) or not loaded.isa_supported():
        raise KernelBuildError(f"the {isa} kernel build is not one this CPU runs")
    _LOADED.add(isa)
    return loaded


def kernels_in_use() -> str | None:
    """The instruction set of the kernels running here, once this process has loaded them to
    run on (None before: nothing ran on them), as `generate --stats` and `bench` say it."""
    try:
        isa = kernel_isa() if _LOADED else None
    except UsageError:
        return None
    return isa if isa in _LOADED else None


@contextlib.contextmanager
def using_isa(isa: str) -> Iterator[None]:
    """Run the kernels of `isa` inside the block (in this thread or task only): the same
    numbers, another speed. An instruction set this CPU lacks is an error here."""
    library(isa)
    token = _SELECTED.set(isa)
    try:
        yield
    finally:
        _SELECTED.reset(token)


def c_compiler() -> str | None:
    """The C compiler command the kernels are built with, as one string (None: none found)."""
    try:
        return " ".join(compiler_command())
    except KernelBuildError:
        return None


def _build(compiler: str, target: Path, files: Sequence[Path], isa: str | None = None) -> None:
    """Compile `files` into `target` as the package builds `isa`'s library (benchmarks build
    other revisions' kernels with it)."""
    import shlex

    from specdraft.models.kernels.build import _compile

    _compile(shlex.split(compiler), files, flags(isa or kernel_isa()), target)


def interface_of(loaded: ctypes.CDLL) -> int:
    """The signatures' version of a build (cpu_boundary.c `kernel_interface`; 1 before it)."""
    return int(loaded.kernel_interface()) if hasattr(loaded, "kernel_interface") else 1


def vnni_available() -> bool:
    """Whether this CPU runs the block products on AVX-512 VNNI."""
    return isa_available("vnni")


def kernel_version() -> str:
    """Which kernels run: the build (sources, flags, compiler) and its instruction set.
    Measured costs of a model on these kernels are keyed by it."""
    return f"{library().build_id}-{kernel_isa()}"


def parent_rows(function: str, parents: torch.Tensor | None, n: int) -> int | None:
    """The address of a token tree's parent rows (int32 [n]; None for a chain)."""
    return None if parents is None else address(function, "parents", parents, (n,), torch.int32)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     parents: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q [n, H, D] of a block at KV slots start.. over keys and values [KVH, capacity, D]
    (float32, contiguous, the block's own slots already written): [n, H, D], each row the same
    whatever n; `parents` (int32 [n], parents[0] = -1) makes the block a token tree whose rows
    attend their own paths; `window` (0: none): each row attends its last `window` positions
    (cpu_attention.c)."""
    name = "causal_attention"
    if q.dim() != 3 or keys.dim() != 3:
        raise ValueError(f"{name}: q must be [n, H, D] and keys [KVH, capacity, D], not {tuple(q.shape)} and "
                         f"{tuple(keys.shape)}")
    n, heads, dim = q.shape
    kv_heads, capacity, _ = keys.shape
    pointers = [address(name, "q", q), address(name, "keys", keys, (kv_heads, capacity, dim)),
                address(name, "values", values, (kv_heads, capacity, dim))]
    out = torch.empty(n, heads, dim, dtype=torch.float32)
    check_status(name, library().causal_attention(*pointers, n, start, heads, kv_heads, dim, capacity, dim ** -0.5,
                                                   parent_rows(name, parents, n), window, out.data_ptr(),
                                                   torch.get_num_threads()))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of float32 `x` (contiguous), each row alone (cpu_kernels.c)."""
    dim = x.shape[-1] if x.dim() else 0
    pointers = [address("rms_norm_rows", "x", x), address("rms_norm_rows", "weight", weight, (dim,))]
    out = torch.empty(x.shape, dtype=torch.float32)
    check_status("rms_norm_rows", library().rms_norm_rows(*pointers, x.numel() // dim, dim, eps, out.data_ptr()))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (float32, contiguous, same shape); returns RMSNorm(x) * weight."""
    name, dim = "add_rms_norm_rows", x.shape[-1] if x.dim() else 0
    pointers = [address(name, "x", x), address(name, "delta", delta, x.shape), address(name, "weight", weight, (dim,))]
    out = torch.empty(x.shape, dtype=torch.float32)
    check_status(name, library().add_rms_norm_rows(*pointers, x.numel() // dim, dim, eps, out.data_ptr()))
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> [..., I]: silu(gate) * up (float32, contiguous)."""
    return _gated("swiglu_rows", gate_up)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> [..., I]: gelu(gate) * up, gelu's tanh form (float32, contiguous)."""
    return _gated("geglu_rows", gate_up)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width == 0 or width % 2:
        raise ValueError(f"{name}: gate_up's last dimension {width} is not even and positive (gate, then up)")
    pointer, inner = address(name, "gate_up", gate_up), width // 2
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=torch.float32)
    check_status(name, getattr(library(), name)(pointer, gate_up.numel() // width, inner, out.data_ptr()))
    return out


def attention_block(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, start: int, heads: int, parents: torch.Tensor | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, window: int = 0,
                    scale: float | None = None) -> torch.Tensor:
    """The fused projection's output qkv [n, (H + 2 KVH) D] at positions start.. -> the
    attended values [n, H D]; normalizes each head's queries and keys by `qk_norm` (the
    weights [D] of each and the epsilon; None: not), rotates them by cos, sin [n, D] and writes
    keys and values [KVH, capacity, D] at those positions (cpu_common.c, cpu_attention.c);
    `window`: causal_attention's; `scale`: of the scores (None: D ** -0.5)."""
    name = "attention_block"
    if keys.dim() != 3:
        raise ValueError(f"{name}: keys must be [KVH, capacity, D], not {tuple(keys.shape)}")
    kv_heads, capacity, dim = keys.shape
    n = qkv.shape[0] if qkv.dim() else 0
    pointers = [address(name, "qkv", qkv, (n, (heads + 2 * kv_heads) * dim)), address(name, "cos", cos, (n, dim)),
                address(name, "sin", sin, (n, dim)), address(name, "keys", keys),
                address(name, "values", values, keys.shape)]
    norms = [None, None, 0.0] if qk_norm is None else \
        [address(name, "q_norm", qk_norm[0], (dim,)), address(name, "k_norm", qk_norm[1], (dim,)), qk_norm[2]]
    out = torch.empty(n, heads * dim, dtype=torch.float32)
    check_status(name, library().attention_block(pointers[0], n, start, heads, kv_heads, dim, *norms, *pointers[1:],
                                                 capacity, dim ** -0.5 if scale is None else scale,
                                                 parent_rows(name, parents, n), window, out.data_ptr(),
                                                 torch.get_num_threads()))
    return out
