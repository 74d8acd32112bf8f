"""The root folder of every cache specdraft keeps (GGUF conversions, width-cost curves,
learned stores, built kernels): SPECDRAFT_CACHE_DIR, else $XDG_CACHE_HOME/specdraft, else
~/.cache/specdraft. Read at each call, so tests and users can point it elsewhere."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    configured = os.environ.get("SPECDRAFT_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdraft"
