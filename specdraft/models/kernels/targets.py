"""Which of the kernels' instruction sets a CPU runs, and how each library is compiled there.

- `scalar`: plain C, no -m or -march flag: every CPU (and the reference the others are held to);
- `avx2`, `vnni`: x86-64 with AVX2/FMA/F16C, and AVX-512 VNNI on top;
- `neon`: AArch64 (NEON is part of every AArch64 CPU), compiled with the dot-product
  instruction (`-march=armv8.2-a+dotprod`) where the CPU reports it (Linux: `asimddp` in
  /proc/cpuinfo; macOS: the compiler's default CPU, which has it on every Apple Silicon chip),
  else with widening multiplies; the build itself checks the CPU again before it is used
  (cpu_boundary.c `isa_supported`).

OpenMP: gcc and Linux's clang take -fopenmp; Apple's clang does not, so on macOS the kernels
link Homebrew's libomp where it is installed, and are built without OpenMP (one thread per
product) where it is not.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

ISAS = ("scalar", "avx2", "vnni", "neon")  # index: the build's SPECDRAFT_ISA (cpu_kernels_shared.h)
ISA_CHOICES = ("auto", *ISAS)  # SPECDRAFT_KERNEL_ISA
FASTEST_FIRST = ("neon", "vnni", "avx2", "scalar")
COMMON = ("cpu_common.c", "cpu_decoder.c", "cpu_experts.c", "cpu_repack.c", "cpu_boundary.c")  # plain C, in every library
VECTOR = ("cpu_kernels.c", "cpu_kernels_six.c", "cpu_attention.c")
ISA_SOURCES = {"scalar": ("cpu_kernels_scalar.c", "cpu_attention_scalar.c"), "avx2": VECTOR,
               "vnni": (*VECTOR, "cpu_kernels_vnni.c"), "neon": ("cpu_kernels_neon.c", "cpu_attention_neon.c")}
HEADER_NAMES = ("cpu_kernels_shared.h", "cpu_kernels_vector.h", "cpu_kernels_scalar.h", "cpu_kernels_neon.h")
CORE_FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]
OPENMP_FLAGS = ["-fopenmp"]
VECTOR_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
DOTPROD_FLAGS = ["-march=armv8.2-a+dotprod"]
CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"),
             "vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")}
X86 = ("x86_64", "amd64", "i386", "i686", "x86")
ARM64 = ("aarch64", "arm64")
NEEDS = {"vnni": "AVX-512 VNNI", "avx2": "AVX2/FMA/F16C", "neon": "AArch64 NEON"}
LIBOMP_PREFIXES = ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp")


def flags(isa: str, system: str | None = None, machine: str | None = None) -> list[str]:
    """The compiler flags of `isa`'s library on this platform (or the one named)."""
    system = system or platform.system()
    extra = {"scalar": [], "avx2": VECTOR_FLAGS, "vnni": VECTOR_FLAGS,
             "neon": neon_flags(system, machine or platform.machine())}[isa]
    return CORE_FLAGS + openmp_flags(system) + extra + [f"-DSPECDRAFT_ISA={ISAS.index(isa)}"]


def openmp_flags(system: str, prefixes: tuple[str, ...] = LIBOMP_PREFIXES) -> list[str]:
    """-fopenmp, or on macOS Homebrew's libomp (nothing where it is not installed)."""
    if system != "Darwin":
        return list(OPENMP_FLAGS)
    for prefix in prefixes:
        if (Path(prefix) / "include" / "omp.h").exists():
            return ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include", f"-L{prefix}/lib", "-lomp",
                    f"-Wl,-rpath,{prefix}/lib"]
    return []


def neon_flags(system: str, machine: str, features: frozenset[str] | None = None) -> list[str]:
    """+dotprod where a Linux AArch64 CPU reports it in `features` (None: this CPU's; macOS:
    the compiler's default CPU)."""
    features = cpu_features() if features is None else features
    if system == "Linux" and machine.lower() in ARM64 and "asimddp" in features:
        return list(DOTPROD_FLAGS)
    return []


def isa_available(isa: str) -> bool:
    """Whether this CPU runs `isa`'s library (the scalar one: every CPU)."""
    machine = platform.machine().lower()
    if isa == "scalar":
        return True
    if isa == "neon":
        return machine in ARM64
    return machine in X86 and _x86_has(*CPU_FLAGS[isa])


def fastest_available() -> str:
    return next(isa for isa in FASTEST_FIRST if isa_available(isa))


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's feature names as Linux lists them (x86 `flags`, ARM `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((row for row in text.splitlines() if row.split(":")[0].strip() in ("flags", "Features")), "")
    return frozenset(line.split(":", 1)[-1].split())


def _x86_has(*names: str) -> bool:
    if not os.path.exists("/proc/cpuinfo"):  # not Linux: ask torch what it dispatches to (no VNNI: AVX2 then)
        return "avx512_vnni" not in names and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return all(name in cpu_features() for name in names)
