"""Shared fixtures: offline mode, a private cache folder, and tiny models saved as
checkpoints for CLI tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_tiny_pair  # noqa: E402
from specdraft.storage.cache_root import cache_dir  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The suite never reads or writes the user's cache folder: a width-cost curve or a
    learned store written there while the tests load the CPU would be kept and used by the
    user's real runs, and one left by an earlier run would change what a test sees. Converted
    GGUF weights are the exception (a property of the file, not of the machine's load): the
    private folder links to the user's, so the real-model tests convert once per machine."""
    private = tmp_path_factory.mktemp("specdraft-cache")
    try:
        (cache_dir() / "gguf").mkdir(parents=True, exist_ok=True)
        (private / "gguf").symlink_to(cache_dir() / "gguf", target_is_directory=True)
    except OSError:
        pass  # the user's cache cannot be written: conversions go to the private folder
    before = os.environ.get("SPECDRAFT_CACHE_DIR")
    os.environ["SPECDRAFT_CACHE_DIR"] = str(private)
    yield private
    if before is None:
        os.environ.pop("SPECDRAFT_CACHE_DIR", None)
    else:
        os.environ["SPECDRAFT_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A folder with `target/` and `drafter/`: tiny float64 llamas sharing a byte tokenizer."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_pair(root / "target", seed=0)
    save_tiny_pair(root / "drafter", seed=1)
    return root


POOL = """
[target]
path = "{root}/target"
dtype = "float64"

[decode]
draft_tokens = 4
max_new_tokens = 24

[policy]
name = "random"

[[drafters]]
name = "lookup"
kind = "ngram"

[[drafters]]
name = "small"
kind = "model"
path = "{root}/drafter"
dtype = "float64"

[[drafters]]
name = "half"
kind = "layers"
layers = 2
"""


@pytest.fixture
def pool_file(tiny_models, tmp_path) -> Path:
    file = tmp_path / "pool.toml"
    file.write_text(POOL.format(root=tiny_models))
    return file
