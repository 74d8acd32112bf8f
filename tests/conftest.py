"""Shared fixtures: offline mode, and tiny models saved as checkpoints for CLI tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_tiny_pair  # noqa: E402


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
