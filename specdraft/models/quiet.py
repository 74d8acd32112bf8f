"""Quiet third-party libraries: what a command or a script asks for before transformers
loads, and what is applied once it does.

Setting only environment variables and warning filters beforehand keeps the request cheap:
importing transformers costs seconds, and a command that stops at a profile error must not
pay for it. `SPECDRAFT_QUIET` carries the request to the model loaders, which call
`apply_to_transformers` when they import transformers.
"""

from __future__ import annotations

import os
import warnings


def quiet_environment() -> None:
    """Ask for no progress bars, warnings or info lines from transformers, huggingface_hub,
    tokenizers and tqdm in this process (before or after they load)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["SPECDRAFT_QUIET"] = "1"  # read by apply_to_transformers when a model loads
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion uses tqdm directly
    warnings.filterwarnings("ignore")


def apply_to_transformers() -> None:
    """Apply a quiet request (`quiet_environment`, or the command line's) now that
    transformers loads."""
    if not os.environ.get("SPECDRAFT_QUIET"):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
