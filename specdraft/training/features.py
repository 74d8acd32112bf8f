"""The frozen target's features over a training corpus, computed once and kept on disk.

Training a drafter needs, at every position of the corpus, the target's hidden state(s)
and its next-token distribution; the distribution is one head projection of the final
feature, so only hidden states are stored (float16, memory-mapped). Documents are joined
with the end-of-text token and cut into sequences of `seq_len` tokens (teacher forcing:
one target forward per sequence, far cheaper than generating). The folder is named after
the target, the token stream and the layers, so a second training run on the same data
skips the target pass, and a run killed half-way resumes at the first unfinished batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specdraft.storage.atomic_files import write_text
from specdraft.models.kernels.packed_linear import packed_while
from specdraft.training.corpus import Document

FP16_MAX = 65000.0


@dataclass
class FeatureSet:
    folder: Path
    tokens: np.ndarray  # [sequences, seq_len] int32
    features: dict[int, np.ndarray]  # {layer: [sequences, seq_len, H] float16}
    # [sequences, seq_len] bool: tokens a drafter learns to predict (answers and plain text,
    # not the prompts of chat exchanges); None: every token
    answer_mask: np.ndarray | None = None

    def learned(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), seq_len] bool: which tokens of `rows` a drafter learns to predict."""
        if self.answer_mask is None:
            return np.ones((len(rows), self.seq_len), dtype=bool)
        return np.asarray(self.answer_mask[rows], dtype=bool)

    @property
    def sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


class RowBatches:
    """Training rows in batches: every row once per epoch, each epoch in a new random order."""

    def __init__(self, rows: np.ndarray, batch: int, seed: int):
        self.rows, self.batch = rows, batch
        self.generator = np.random.default_rng(seed)
        self.order = np.array([], dtype=np.int64)

    def next(self) -> np.ndarray:
        if len(self.order) < self.batch:
            self.order = np.concatenate([self.order, self.generator.permutation(self.rows)])
        rows, self.order = self.order[: self.batch], self.order[self.batch :]
        return rows


def token_stream(docs: Sequence[Document], tokenizer: Any, chat: bool, separator: int | None
                 ) -> tuple[list[int], list[bool]]:
    """Every document's tokens in order, exchanges in the chat template when `chat`, each
    plain document followed by `separator` (the end-of-text token); and for each token
    whether it is one a drafter learns to predict: an exchange's prompt (its chat template
    up to the assistant's turn) is not, since at decode time the drafter never drafts it."""
    out: list[int] = []
    answer: list[bool] = []
    for doc in docs:
        if doc.exchange is not None and chat:
            prompt, reply = doc.exchange
            ids = _ids(tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                      {"role": "assistant", "content": reply}], tokenize=True))
            asked = _ids(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                       add_generation_prompt=True))
            # a template that does not render the question the same way in both: learn all of it
            start = len(asked) if ids[: len(asked)] == asked else 0
            out += ids
            answer += [False] * start + [True] * (len(ids) - start)
        else:
            text = doc.text if doc.exchange is None else "\n".join(doc.exchange)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([separator] if separator is not None else [])
            out += ids
            answer += [True] * len(ids)
    return out, answer


def _ids(rendered: Any) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def sequences_of(stream: list, seq_len: int, max_tokens: int | None, dtype: Any = np.int32) -> np.ndarray:
    """[n, seq_len]: the stream cut into whole sequences (the tail shorter than one is dropped)."""
    if max_tokens is not None:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=dtype).reshape(n, seq_len)


def feature_key(signature: str, tokens: np.ndarray, layers: Sequence[int]) -> str:
    digest = hashlib.sha256()
    digest.update(signature.encode())
    digest.update(json.dumps(list(layers)).encode())
    digest.update(np.ascontiguousarray(tokens).tobytes())
    digest.update(str(tokens.shape).encode())
    return digest.hexdigest()[:16]


def extract_features(target: torch.nn.Module, tokens: np.ndarray, layers: Sequence[int], folder: Path,
                     progress: Callable[[int, int], None] | None = None, batch_tokens: int = 4096) -> FeatureSet:
    """The target's hidden states after each of `layers` at every position of `tokens`
    [n, seq_len], written under `folder` (resumed where a previous run stopped)."""
    folder.mkdir(parents=True, exist_ok=True)
    n, seq_len = tokens.shape
    hidden = int(target.config.hidden_size)
    meta_path, done_path = folder / "meta.json", folder / "done.json"
    wanted = list(layers)
    meta = _describe(tokens, wanted, hidden)
    old = _read_json(meta_path)
    if old is not None and _holds(old, meta):  # the same tokens, and all these layers (maybe more): served and completed as it is
        meta["layers"] = layers = old["layers"]
    else:
        done_path.unlink(missing_ok=True)  # other tokens, another shape or fewer layers: start over
    recorded = (_read_json(done_path) or {}).get("sequences")
    done = recorded if isinstance(recorded, int) and 0 <= recorded <= n else 0
    try:  # resumed arrays that are missing or of another shape are started over, not trusted
        arrays = {layer: np.lib.format.open_memmap(folder / f"features-{layer}.npy", mode="r+" if done else "w+",
                                                   dtype=np.float16, shape=(n, seq_len, hidden)) for layer in layers}
        if any(a.shape != (n, seq_len, hidden) or a.dtype != np.float16 for a in arrays.values()):
            raise ValueError("another shape")
    except (OSError, ValueError):
        done = 0
        arrays = {layer: np.lib.format.open_memmap(folder / f"features-{layer}.npy", mode="w+", dtype=np.float16,
                                                   shape=(n, seq_len, hidden)) for layer in layers}
    write_text(meta_path, json.dumps(meta))
    batch = max(1, batch_tokens // seq_len)
    device = next(target.parameters()).device
    started = time.perf_counter()
    # Packed linears (on a CPU) and no logits but the last position's: the pass wants hidden
    # states only, and the head's product over every position was a fifth of its time.
    with torch.inference_mode(), packed_while(target):
        for first in range(done, n, batch):
            ids = torch.from_numpy(tokens[first : first + batch].astype(np.int64)).to(device)
            out = target(ids, output_hidden_states=True, logits_to_keep=1)
            for layer in layers:
                states = out.hidden_states[layer].float().clamp_(-FP16_MAX, FP16_MAX)
                arrays[layer][first : first + ids.shape[0]] = states.cpu().numpy().astype(np.float16)
            for array in arrays.values():
                array.flush()
            done = first + ids.shape[0]
            write_text(done_path, json.dumps({"sequences": done, "seconds": time.perf_counter() - started}))
            if progress is not None:
                progress(done, n)
    return FeatureSet(folder, tokens, {layer: np.load(folder / f"features-{layer}.npy", mmap_mode="r")
                                       for layer in wanted})


def _read_json(path: Path) -> dict | None:
    """A JSON object written by this module, or None when missing or damaged."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _describe(tokens: np.ndarray, layers: Sequence[int], hidden: int | None) -> dict[str, Any]:
    """What a features folder's meta.json says it holds. The tokens' digest is part of it: a
    --features folder given for other data of the same shape is not reused."""
    return {"sequences": tokens.shape[0], "seq_len": tokens.shape[1], "hidden": hidden, "layers": list(layers),
            "tokens": hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:16]}


def _holds(stored: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether features described by `stored` (meta.json) include all of `wanted`'s."""
    same = all(stored.get(key) == wanted[key] for key in ("sequences", "seq_len", "hidden", "tokens"))
    return same and set(wanted["layers"]) <= set(stored.get("layers", ()))


def finished(folder: Path, tokens: np.ndarray, layers: Sequence[int]) -> bool:
    """Whether `folder` holds the features of `layers` at every position of `tokens`."""
    done, stored = _read_json(folder / "done.json"), _read_json(folder / "meta.json")
    if done is None or stored is None or done.get("sequences") != tokens.shape[0] \
            or not all((folder / f"features-{layer}.npy").exists() for layer in layers):
        return False
    return _holds(stored, _describe(tokens, layers, stored.get("hidden")))
