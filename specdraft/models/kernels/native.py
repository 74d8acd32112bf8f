"""specdraft's own CPU kernels (cpu_kernels.c and the files beside it), built on first use and
loaded with ctypes.

The C files need no torch headers: the machine's C compiler builds them in seconds, keyed by
the sources, the flags and the compiler, so an upgrade or another machine builds its own;
kernels/build.py builds, records and checks each build before it is loaded. They target AVX2
with FMA and F16C (every x86 CPU of the last ten years); the block products also come in an
AVX-512 VNNI build (cpu_kernels_vnni.c, compiled for that target alone and chosen at run time
where the CPU has it) that gives the same numbers bit for bit in fewer instructions a row.
Without AVX2, or without a compiler, `kernel_problem` says why, and callers keep torch's
kernels; SPECDRAFT_KERNEL_ISA names a choice (auto, avx2, vnni), and one that cannot run here
is a usage error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path
from typing import Sequence

import torch

from specdraft.errors import UsageError
from specdraft.models.kernels.build import KernelBuildError, compiler_command, compiler_version, load_library

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("cpu_kernels.c", "cpu_kernels_vnni.c", "cpu_attention.c", "cpu_decoder.c", "cpu_repack.c",
                                 "cpu_kernels_six.c"))
HEADER = Path(__file__).with_name("cpu_kernels_shared.h")  # included by every source
# SPECDRAFT_KERNEL_ISA: the block products' instruction set (auto: AVX-512 VNNI where the CPU
# has it, else AVX2). The results are the same bit for bit; avx2 measures what an AVX2-only
# CPU would run.
ISA_CHOICES = {"auto": 1, "vnni": 1, "avx2": 0}  # vnni on a CPU without it is refused
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]


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
def library() -> ctypes.CDLL:
    """The built kernels, loaded (built first where this source, compiler and flags never were;
    kernels/build.py checks that a build is ours before loading it)."""
    chosen = os.environ.get("SPECDRAFT_KERNEL_ISA", "auto")
    if chosen not in ISA_CHOICES:
        raise UsageError(f"SPECDRAFT_KERNEL_ISA={chosen}: expected one of {', '.join(ISA_CHOICES)}")
    if not _cpu_has("avx2", "fma", "f16c"):
        raise KernelBuildError("this CPU lacks AVX2/FMA/F16C")
    command = compiler_command()
    version = compiler_version(command)
    code = b"".join(source.read_bytes() for source in (*SOURCES, HEADER))
    digest = hashlib.sha256(code + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    loaded = _declared(load_library("cpu_kernels", SOURCES, FLAGS, digest))
    loaded.build_id = digest
    if chosen == "vnni" and not loaded.vnni_supported():
        raise UsageError("SPECDRAFT_KERNEL_ISA=vnni: this CPU has no AVX-512 VNNI (use auto or avx2)")
    loaded.kernel_isa(ISA_CHOICES[chosen])
    return loaded


def c_compiler() -> str | None:
    """The C compiler command the kernels are built with, as one string (None: none found)."""
    try:
        return " ".join(compiler_command())
    except KernelBuildError:
        return None


def _build(compiler: str, target: Path, sources: Sequence[Path] = SOURCES) -> None:
    """Compile `sources` into `target` as the package builds its own (benchmarks build other
    revisions' kernels with it)."""
    import shlex

    from specdraft.models.kernels.build import _compile

    _compile(shlex.split(compiler), sources, FLAGS, target)


def interface_of(loaded: ctypes.CDLL) -> int:
    """The signatures' version of a build (cpu_kernels.c `kernel_interface`; 1 before it)."""
    return int(loaded.kernel_interface()) if hasattr(loaded, "kernel_interface") else 1


def _declared(loaded: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' C signatures, so ctypes passes each argument as the C side reads it."""
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    loaded.kernel_interface.restype = integer
    loaded.kernel_interface.argtypes = []
    loaded.kernel_isa.restype = integer
    loaded.kernel_isa.argtypes = [integer]
    loaded.vnni_supported.restype = integer
    loaded.vnni_supported.argtypes = []
    loaded.block_matmul.restype = integer
    loaded.block_matmul.argtypes = [pointer, integer, integer, pointer, pointer, pointer, integer, integer, integer,
                                    integer, pointer, integer]
    loaded.block_rows.restype = integer
    loaded.block_rows.argtypes = [pointer, pointer, pointer, integer, integer, integer, integer, integer, pointer,
                                  integer, pointer]
    loaded.causal_attention.restype = integer
    loaded.causal_attention.argtypes = [pointer, pointer, pointer, integer, integer, integer, integer, integer,
                                        integer, ctypes.c_float, pointer, pointer, integer]
    loaded.rms_norm_rows.restype = None
    loaded.rms_norm_rows.argtypes = [pointer, pointer, integer, integer, ctypes.c_float, pointer]
    loaded.add_rms_norm_rows.restype = None
    loaded.add_rms_norm_rows.argtypes = [pointer, pointer, pointer, integer, integer, ctypes.c_float, pointer]
    loaded.swiglu_rows.restype = None
    loaded.swiglu_rows.argtypes = [pointer, integer, integer, pointer]
    loaded.decoder_layers.restype = integer
    loaded.decoder_layers.argtypes = [pointer, integer, integer, integer, pointer, integer, integer, integer, integer,
                                      pointer, pointer, integer, pointer, pointer, ctypes.c_float, pointer, integer]
    loaded.attention_block.restype = integer
    loaded.attention_block.argtypes = [pointer, integer, integer, integer, integer, integer, pointer, pointer,
                                       pointer, pointer, integer, ctypes.c_float, pointer, pointer, integer]
    loaded.repack_terms.restype = integer
    loaded.repack_terms.argtypes = [integer]
    loaded.repack_bits.restype = integer
    loaded.repack_bits.argtypes = [integer]
    loaded.repack_tensor.restype = integer
    loaded.repack_tensor.argtypes = [pointer, ctypes.c_int64, integer, ctypes.c_int64, ctypes.c_int64, pointer, pointer,
                                     pointer, pointer, integer, integer]
    return loaded


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: ask torch what it dispatches to
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return all(flag in have for flag in flags)




def vnni_available() -> bool:
    """Whether this CPU runs the block products on AVX-512 VNNI."""
    return bool(library().vnni_supported())


def kernel_version() -> str:
    """Which kernels run: the build (source, flags, compiler) and the products' instruction set.
    Measured costs of a model on these kernels are keyed by it."""
    return f"{library().build_id}-{'vnni' if kernel_isa() else 'avx2'}"


def kernel_isa(request: int = -1) -> int:
    """Choose the block products' kernels for this process: 0 AVX2, 1 AVX-512 VNNI where the
    CPU has it, -1 keeps the current choice (VNNI where available). Returns 1 when VNNI runs.
    Both give the same numbers bit for bit; benchmarks and tests compare them."""
    return int(library().kernel_isa(request))


def parent_rows(parents: torch.Tensor | None) -> int | None:
    """The address of a token tree's parent rows (int32, contiguous; None for a chain)."""
    return None if parents is None else parents.data_ptr()


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     parents: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] of a block at KV slots start.. over keys and values [KVH, capacity, D]
    (float32, contiguous, the block's own slots already written): [n, H, D], each row the same
    whatever n; `parents` (int32 [n], parents[0] = -1) makes the block a token tree whose rows
    attend their own paths (cpu_kernels.c)."""
    n, heads, dim = q.shape
    out = torch.empty_like(q)
    status = library().causal_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), n, start, heads,
                                        keys.shape[0], dim, keys.shape[1], dim ** -0.5, parent_rows(parents),
                                        out.data_ptr(), torch.get_num_threads())
    if status:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of float32 `x` (contiguous), each row alone (cpu_kernels.c)."""
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().rms_norm_rows(x.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (float32, contiguous, same shape); returns RMSNorm(x) * weight."""
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().add_rms_norm_rows(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps,
                                out.data_ptr())
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> [..., I]: silu(gate) * up (float32, contiguous)."""
    inner = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inner)
    library().swiglu_rows(gate_up.data_ptr(), gate_up.numel() // (2 * inner), inner, out.data_ptr())
    return out


def attention_block(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, start: int, heads: int, parents: torch.Tensor | None = None) -> torch.Tensor:
    """The fused projection's output qkv [n, (H + 2 KVH) D] at positions start.. -> the
    attended values [n, H D]; rotates queries and keys by cos, sin [n, D] and writes keys and
    values [KVH, capacity, D] at those positions (cpu_kernels.c)."""
    n = qkv.shape[0]
    kv_heads, capacity, dim = keys.shape
    out = torch.empty(n, heads * dim)
    status = library().attention_block(qkv.data_ptr(), n, start, heads, kv_heads, dim, cos.data_ptr(),
                                       sin.data_ptr(), keys.data_ptr(), values.data_ptr(), capacity, dim ** -0.5,
                                       parent_rows(parents), out.data_ptr(), torch.get_num_threads())
    if status:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
    return out
