"""Where a model comes from and how it is placed: `[target]` and every model-backed
drafter use the same keys (one source of hub | path | package + file, allow_download,
dtype, device, quantization, trust_remote_code). Checked here, without importing torch:
a malformed device is a profile error; whether the machine has it is checked at load."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from specdraft.config.tables import Table

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
# gguf: a .gguf model on its file's own block codes and scales (CPU; the default there);
# none: dequantized into `dtype`;
# int8 / int4: weight-only, requantized, on torch's own CPU kernels (bitsandbytes on CUDA);
# 8bit / 4bit: bitsandbytes, CUDA only.
QUANTIZATIONS = ("gguf", "none", "int8", "int4", "8bit", "4bit")
MODEL_KEYS = ("hub", "path", "package", "file", "allow_download", "dtype", "device", "quantization",
              "trust_remote_code")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelSpec:
    hub: str | None = None  # a hub id, resolved from the local Hugging Face cache only ...
    allow_download: bool = False  # ... unless this is true: then missing files are downloaded
    path: Path | None = None  # a local folder or a .gguf file
    package: str | None = None  # an installed Python package that ships the file ...
    file: str | None = None  # ... at this path inside it
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None  # None: "gguf" for a .gguf model on a CPU, else "none"
    trust_remote_code: bool = False

    def describe(self) -> str:
        if self.hub:
            return self.hub
        if self.package:
            return f"{self.package}/{self.file}"
        return str(self.path)


def parse_model_spec(table: Table, base: Path) -> ModelSpec:
    """Read the model keys of `table`; relative paths are relative to the profile's folder `base`."""
    hub = table.get("hub", str)
    raw_path = table.get("path", str)
    package = table.get("package", str)
    file = table.get("file", str)
    sources = [k for k, v in (("hub", hub), ("path", raw_path), ("package", package)) if v is not None]
    if len(sources) != 1:
        given = ", ".join(sources) if sources else "none"
        raise table.error(None, f"give exactly one model source of hub, path, package (given: {given})")
    if package is not None and file is None:
        raise table.error("file", "package needs file = the model file's path inside the package")
    if file is not None and package is None:
        raise table.error("file", "file is only used together with package")
    allow_download = table.get("allow_download", bool, False)
    if allow_download and hub is None:
        raise table.error("allow_download", "only a hub source can be downloaded; path and package are local")
    path = None
    if raw_path is not None:
        path = Path(raw_path).expanduser()
        if not path.is_absolute():
            path = base / path
        if not path.exists():
            raise table.error("path", f"model path not found: {path}")
    spec = ModelSpec(
        hub=hub,
        path=path,
        package=package,
        file=file,
        allow_download=allow_download,
        dtype=table.choice("dtype", DTYPES, "auto"),
        device=table.get("device", str, "auto"),
        quantization=table.choice("quantization", QUANTIZATIONS, None),
        trust_remote_code=table.get("trust_remote_code", bool, False),
    )
    if spec.quantization == "gguf" and not (spec.path or Path(spec.file or "")).name.endswith(".gguf"):
        raise table.error("quantization", 'quantization = "gguf" runs a .gguf model on its own quantization; '
                                          "this model is not a .gguf file")
    if not _DEVICE.fullmatch(spec.device):
        raise table.error("device", f'unknown device "{spec.device}"; expected auto, cpu, cuda, cuda:N or mps')
    table.finish()
    return spec
