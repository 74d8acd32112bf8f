"""llama.cpp as a bench peer (`--baseline llama.cpp`): the engine a CPU user already has, run
on the same GGUF file, with the same prompt tokens and new-token budget, through
llama-cpp-python (`pip install 'specdraft[llama]'`, which compiles llama.cpp).

Two configurations: its plain greedy decoding and its prompt-lookup drafting
(`LlamaPromptLookupDecoding`, as many draft tokens as the profile's `draft_tokens`). Each
uses as many threads as the machine has cores and its own model instance and context, reset
before every prompt. Its tokens come from other kernels than specdraft's, so near-ties can
decide differently: the bench reports the share of prompts whose output is identical to
specdraft's plain decoding instead of counting mismatches. A prompt on which llama.cpp fails
(its prompt-lookup decoder has crashed on some prompts) is recorded as failed, and the bench
goes on."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path

from specdraft.profile import Profile
from specdraft.errors import UsageError
from specdraft.measurement.benchmark import Config, Sample, same_text_as
from specdraft.measurement.datasets import Example
from specdraft.models.loading import eos_token_ids, resolve_location
from specdraft.runtime import Runtime
from specdraft.session.prompt_ids import prompt_token_ids

log = logging.getLogger("specdraft")

INSTALL = "pip install 'specdraft[llama]' (compiles llama.cpp, ~5 minutes on 2 cores)"


def llama_cpp_problem(profile: Profile) -> str | None:
    """Why `--baseline llama.cpp` cannot run with this profile, or None (torch-free checks)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed: {INSTALL}"
    spec = profile.target
    name = spec.path.name if spec.path is not None else (spec.file or "")
    if not name.endswith(".gguf"):
        return f"llama.cpp runs GGUF files and the target is {spec.describe()}"
    return None


def gguf_path(profile: Profile) -> Path:
    location, name = resolve_location(profile.target, str(profile.file), "target")
    return Path(location) / name


def llama_cpp_configs(profile: Profile, runtime: Runtime, chat: bool | None) -> list[Config]:
    """llama.cpp's plain greedy decoding and its prompt-lookup decoding on the target's file."""
    problem = llama_cpp_problem(profile)
    if problem is not None:
        raise UsageError(f"--baseline llama.cpp: {problem}")
    path = gguf_path(profile)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = profile.decode.draft_tokens
    return [_config("llama.cpp plain", path, runtime, chat, None),
            _config("llama.cpp prompt-lookup", path, runtime, chat, lambda: LlamaPromptLookupDecoding(num_pred_tokens=k))]


def _config(label: str, path: Path, runtime: Runtime, chat: bool | None, draft) -> Config:
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    max_new = runtime.profile.decode.max_new_tokens
    stops = eos_token_ids(runtime.target.model, runtime.tokenizer)
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=_context(runtime),
                verbose=False, draft_model=draft() if draft is not None else None, logits_all=draft is not None)

    def run(example: Example) -> Sample:
        ids = prompt_token_ids(runtime.tokenizer, example.prompt, chat)
        new: list[int] = []
        failed = None
        llm.reset()
        start = time.perf_counter()
        try:
            for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if token in stops:
                    break
                new.append(int(token))
                if len(new) >= max_new:
                    break
        except Exception as exc:  # a peer's own failure is a result to report, not the bench's end
            failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("%s failed on prompt %s: %s", label, example.id, failed)
        elapsed = time.perf_counter() - start
        return Sample(example.id, example.task, label, 0, len(new), 0, elapsed, ids=new, peer=True, failed=failed)

    return Config(label, run, same_text=same_text_as(runtime.tokenizer))


def _context(runtime: Runtime) -> int:
    """The model's context, at most 8192 tokens (a bench prompt and its answer fit; more
    would only reserve memory)."""
    limit = getattr(runtime.target.model.config, "max_position_embeddings", 4096) or 4096
    return min(int(limit), 8192)
