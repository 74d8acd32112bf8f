"""The ARM NEON kernels against the scalar reference, bit for bit, on an emulated AArch64 CPU:
the package's own sources and flags for each build (targets.py), compiled with Debian's
AArch64 cross compiler, and tests/kernel_parity.c run under qemu-user on every format, scale
form, width and attention shape it covers. The NEON build is checked with the dot-product
instruction (on qemu's `max` CPU) and without it (on `max` and on a Cortex-A53, which lacks
it, where the dot-product build must refuse to run). The harness itself is checked natively
against the x86 builds, and shown to catch a build that rounds differently.

Without the cross tools (`apt-get install gcc-aarch64-linux-gnu qemu-user`) the emulated tests
skip; SPECDRAFT_REQUIRE_CROSS=1 (CI) makes that a failure. Speed on real ARM hardware is not
measured here: emulation says nothing about it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from specdraft.models.kernels import native, targets

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "kernel_parity.c"
KERNELS = ROOT / "specdraft" / "models" / "kernels"
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"


def cross_tools() -> str | None:
    """Why the emulated tests cannot run here, or None."""
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if not missing and Path(SYSROOT).is_dir():
        return None
    why = f"no {', '.join(missing) or SYSROOT} (apt-get install gcc-aarch64-linux-gnu qemu-user)"
    if os.environ.get("SPECDRAFT_REQUIRE_CROSS") == "1":
        pytest.fail(f"SPECDRAFT_REQUIRE_CROSS=1 but {why}")
    return why


@pytest.fixture(scope="module")
def arm_builds(tmp_path_factory):
    """{name: path} of the AArch64 builds (scalar, neon without and with dot products) and the
    harness, compiled as the package compiles them on a Linux AArch64 machine."""
    why = cross_tools()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("aarch64")
    plain = targets.flags("neon", "Linux", "aarch64")
    dotprod = plain[:-1] + targets.neon_flags("Linux", "aarch64", frozenset({"asimddp"})) + plain[-1:]
    builds = {"scalar": (native.sources("scalar"), targets.flags("scalar", "Linux", "aarch64")),
              "neon": (native.sources("neon"), plain), "neon-dotprod": (native.sources("neon"), dotprod)}
    paths = {}
    for name, (files, flags) in builds.items():
        paths[name] = folder / f"{name}.so"
        compile_c([*flags, *map(str, files), "-o", str(paths[name]), "-lm"])
    paths["harness"] = folder / "kernel_parity"
    compile_c(["-O2", f"-I{KERNELS}", str(HARNESS), "-o", str(paths["harness"]), "-ldl", "-lm"])
    return paths


def compile_c(arguments: list[str], compiler: str = CROSS_CC) -> None:
    done = subprocess.run([compiler, *arguments], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def emulated(paths: dict, candidate: str, cpu: str) -> subprocess.CompletedProcess:
    return subprocess.run([QEMU, "-L", SYSROOT, "-cpu", cpu, str(paths["harness"]), str(paths["scalar"]),
                           str(paths[candidate])], capture_output=True, text=True, timeout=600)


def assert_every_case_equal(done: subprocess.CompletedProcess, isa: int) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    cases = int(summary.split(":")[1].split()[0])
    assert summary == f"isa {isa} against isa 0: {cases} cases, 0 differ" and cases >= 400, summary


def test_the_dot_product_build_asks_for_dot_products_and_the_other_does_not():
    assert targets.neon_flags("Linux", "aarch64", frozenset({"asimd", "asimddp"})) == targets.DOTPROD_FLAGS
    assert targets.neon_flags("Linux", "aarch64", frozenset({"asimd"})) == []
    assert targets.neon_flags("Darwin", "arm64", frozenset()) == []  # Apple's default CPU has it
    assert not [flag for flag in targets.flags("neon", "Linux", "aarch64") if flag.startswith("-m")]


@pytest.mark.parametrize("build", ["neon-dotprod", "neon"])
def test_neon_equals_the_scalar_reference_bit_for_bit(arm_builds, build):
    assert_every_case_equal(emulated(arm_builds, build, "max"), targets.ISAS.index("neon"))


def test_neon_without_dot_products_runs_on_a_cpu_without_them(arm_builds):
    assert_every_case_equal(emulated(arm_builds, "neon", "cortex-a53"), targets.ISAS.index("neon"))


def test_the_dot_product_build_refuses_a_cpu_without_them(arm_builds):
    done = emulated(arm_builds, "neon-dotprod", "cortex-a53")
    assert done.returncode == 2 and "does not run its instructions" in done.stderr, done.stderr


def test_the_neon_build_is_the_one_chosen_on_aarch64(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert targets.isa_available("neon") and targets.fastest_available() == "neon"
    assert not targets.isa_available("avx2") and not targets.isa_available("vnni")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert not targets.isa_available("neon") and targets.fastest_available() != "neon"


def test_macos_builds_with_libomp_where_it_is_installed_and_without_openmp_where_not(tmp_path):
    assert targets.openmp_flags("Darwin", (str(tmp_path / "none"),)) == []
    (tmp_path / "libomp" / "include").mkdir(parents=True)
    (tmp_path / "libomp" / "include" / "omp.h").write_text("")
    flags = targets.openmp_flags("Darwin", (str(tmp_path / "none"), str(tmp_path / "libomp")))
    assert flags[:2] == ["-Xpreprocessor", "-fopenmp"] and f"-I{tmp_path}/libomp/include" in flags and "-lomp" in flags
    assert targets.openmp_flags("Linux") == ["-fopenmp"]


@pytest.mark.skipif(platform.machine().lower() not in targets.X86 or native.kernel_problem() is not None,
                    reason="the harness is checked natively on x86 with its kernels")
def test_the_harness_passes_the_x86_builds_and_catches_one_that_rounds_differently(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    harness = tmp_path / "kernel_parity"
    compile_c(["-O2", f"-I{KERNELS}", str(HARNESS), "-o", str(harness), "-ldl", "-lm"], gcc)
    scalar = native.library("scalar")._name
    vector = ["avx2", "vnni"] if native.vnni_available() else ["avx2"]
    for isa in vector:
        done = subprocess.run([str(harness), scalar, native.library(isa)._name], capture_output=True, text=True)
        assert_every_case_equal(done, targets.ISAS.index(isa))
    fused = tmp_path / "fused.so"  # the scalar sources with multiplies and adds fused: other roundings
    flags = [flag.replace("-ffp-contract=off", "-ffp-contract=fast") for flag in targets.flags("scalar")]
    compile_c([*flags, "-mfma", *map(str, native.sources("scalar")), "-o", str(fused), "-lm"], gcc)
    done = subprocess.run([str(harness), scalar, str(fused)], capture_output=True, text=True)
    assert done.returncode == 1 and "FAIL " in done.stdout, done.stdout
