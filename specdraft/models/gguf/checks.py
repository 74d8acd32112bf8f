"""Whether a parsed GGUF header describes a model its tensors can be: checked before any
model is built from it, so a hostile or damaged file is one line naming the cause, never a
build of a hundred thousand layers, a division by zero or text made of NaN.

Checked: the layer count is the number of layers the tensors hold; head counts are
positive and divide as attention needs; the embedding table covers the vocabulary; every
small float tensor (norms, biases) is finite. The quantized matrices are too large to scan
on every load: NaN there surfaces as NaN logits, which decoding refuses (errors.py).
"""

from __future__ import annotations

import re

import numpy as np

from specdraft.models.gguf.file import GGUFError, GGUFFile

MAX_LAYERS = 4096
SMALL_FLOATS = 1 << 22  # elements: a float tensor up to this size is checked for NaN and inf
_FLOAT_TYPES = ("F32", "F16", "BF16")
_LAYER = re.compile(r"blk\.(\d+)\.")


def check_model_header(gguf: GGUFFile) -> None:
    """GGUFError naming `gguf`'s file and the first thing that cannot be a model."""
    name = gguf.path.name
    layers = gguf.field("block_count")
    if not _whole(layers) or not 1 <= layers <= MAX_LAYERS:
        raise GGUFError(f"{name}: block_count {layers!r} is not a layer count from 1 to {MAX_LAYERS}")
    held = {int(m.group(1)) for t in gguf.tensors if (m := _LAYER.match(t))}
    if held and held != set(range(layers)):
        raise GGUFError(f"{name}: its header says {layers} layers but its tensors are for "
                        f"{len(held)} (blk.{min(held)} to blk.{max(held)})")
    _check_heads(gguf, name)
    _check_vocabulary(gguf, name)
    _check_floats(gguf, name)


def _check_heads(gguf: GGUFFile, name: str) -> None:
    heads = _per_layer(gguf.field("attention.head_count"))
    kv_heads = _per_layer(gguf.field("attention.head_count_kv", gguf.field("attention.head_count")))
    if heads is None or any(h < 0 for h in heads) or not any(heads):
        raise GGUFError(f"{name}: attention.head_count {gguf.field('attention.head_count')!r} is not a positive count")
    if kv_heads is None or len(kv_heads) not in (1, len(heads)) and len(heads) != 1:
        raise GGUFError(f"{name}: attention.head_count_kv {gguf.field('attention.head_count_kv')!r} is not a count")
    pairs = zip(heads, kv_heads) if len(heads) == len(kv_heads) else \
        ((h, k) for h in heads for k in kv_heads)
    for h, k in pairs:
        if h == 0:  # a layer without attention (a recurrent or mixing layer) has no pair to check
            continue
        if k <= 0 or h % k:
            raise GGUFError(f"{name}: attention.head_count_kv {k} does not divide attention.head_count {h} "
                            "(every key/value head serves a whole number of query heads)")
    width = gguf.field("embedding_length")
    if not _whole(width) or width <= 0:
        raise GGUFError(f"{name}: embedding_length {width!r} is not a positive width")


def _check_vocabulary(gguf: GGUFFile, name: str) -> None:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    table = gguf.tensors.get("token_embd.weight")
    if table is None or not isinstance(tokens, (list, tuple)) and not hasattr(tokens, "__len__"):
        return
    rows = table.rows_cols[0]
    if rows < len(tokens):
        raise GGUFError(f"{name}: its vocabulary has {len(tokens)} tokens but token_embd.weight only {rows} rows")


def _check_floats(gguf: GGUFFile, name: str) -> None:
    for info in gguf.tensors.values():
        elements = int(np.prod(info.shape, dtype=np.int64))
        if info.type_name in _FLOAT_TYPES and elements <= SMALL_FLOATS:
            if not np.isfinite(gguf.floats(info.name)).all():
                raise GGUFError(f"{name}: tensor {info.name} holds NaN or infinite values")


def _per_layer(value: object) -> list[int] | None:
    """A count given once or per layer, as a list; None when it is not whole numbers."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if not values or not all(_whole(v) for v in values):
        return None
    return [int(v) for v in values]


def _whole(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
