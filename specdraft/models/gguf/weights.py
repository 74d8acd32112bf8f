"""The weights of a mapped GGUF model, built from the file alone: every quantized matrix
repacked into the block products' layout (repack.py, in C), an untied embedding left in the
mapping, float tensors copied as float32. They need nothing but the file's header, not the
config or transformers' module tree (mapping.py puts them there), so they are built on a
thread of their own (`WeightsAhead`) from the moment the header is read: the repack runs in C
outside the GIL while Python imports transformers and reads the config and tokenizer, which
on a 2-core machine are most of a start-up.

Each tensor's pages of the mapping are dropped once its layer holds them, so the load's peak
memory is the model's, not the model's plus the file's.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from specdraft.models.gguf.architectures import ARCHITECTURES
from specdraft.models.gguf.file import GGUFError, GGUFFile, TensorInfo
from specdraft.models.gguf.repack import repacked
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.experts import Experts
from specdraft.models.kernels.fused_linear import Concatenated, fuse
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding, TiedEmbedding

FLOATS = ("F32", "F16", "BF16")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)

# Held while the weights' thread builds a tensor's layer and while mapping.py builds the empty
# module tree: accelerate's `init_empty_weights` puts every parameter registered anywhere in
# the process on the meta device while it is active, a layer built meanwhile included.
MODULES_BUILT = threading.Lock()


@dataclass(frozen=True)
class Placement:
    """Where one file tensor goes: a matrix (module path), or a float tensor (parameter name)."""

    tensor: TensorInfo
    target: str
    matrix: bool
    expert: str | None = None  # a stacked expert tensor: which matrix of each expert (target: the experts)


class Stopped(Exception):
    """The build was cancelled (the load failed elsewhere or was interrupted)."""


@dataclass
class Weights:
    """What the file holds, by where it goes in transformers' module tree."""

    modules: dict[str, nn.Module] = field(default_factory=dict)  # module path -> layer
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> float32 tensor


def build_weights(gguf: GGUFFile, places: list[Placement], tied: bool, progress: Progress | None = None,
                  stopped: Callable[[], bool] = lambda: False) -> Weights:
    """Every tensor of `places` (mapping.placements) built from the mapped file."""
    weights, experts = Weights(), {}
    norm_offset = ARCHITECTURES[gguf.architecture].norm_offset
    biases = {place.target: place for place in places if not place.matrix and place.target.endswith(".bias")}
    total, done = sum(place.tensor.nbytes for place in places), 0
    for place in places:
        if stopped():
            raise Stopped
        info = place.tensor
        if place.expert:
            with MODULES_BUILT:
                experts.setdefault(place.target, {})[place.expert] = _expert_matrices(gguf, info)
        elif place.matrix:
            with MODULES_BUILT:
                _matrix(weights, gguf, place, biases.get(f"{place.target}.bias"), tied)
        else:
            weights.state[place.target] = torch.from_numpy(np.array(gguf.floats(info.name)))  # a copy: pages are released
            if norm_offset and place.target.endswith("norm.weight"):
                weights.state[place.target] -= norm_offset
        if not (place.target == "model.embed_tokens" and not tied):
            release(gguf, info)  # its pages are in the layer now: the mapping need not hold them
        done += info.nbytes
        if progress is not None:
            progress(done, total)
    for path, kinds in experts.items():
        if set(kinds) != {"gate", "up", "down"}:
            raise GGUFError(f"{gguf.path.name}: the experts of {path} lack {', '.join({'gate', 'up', 'down'} - set(kinds))}")
        # (side by side, not fused: a copy per expert would fragment the heap a large model loads into)
        with MODULES_BUILT:
            gate_up = [Concatenated([gate, up]) for gate, up in zip(kinds["gate"], kinds["up"])]
            weights.modules[path] = Experts(gate_up, kinds["down"])
    with MODULES_BUILT:
        _fuse_projections(weights.modules)
    for path, module in weights.modules.items():  # a repacked matrix holds its bias itself
        if isinstance(module, BlockLinear):
            weights.state.pop(f"{path}.bias", None)
    return weights


def _fuse_projections(modules: dict[str, nn.Module]) -> None:
    """Each layer's query/key/value and gate/up matrices moved into one buffer each, as the
    lean forward runs them (fused_linear.fuse): done here, on the weights' thread, the copy
    costs a start-up nothing, and the lean forward's own fuse finds them joined already."""
    for path in [p.removesuffix(".self_attn.q_proj") for p in modules if p.endswith(".self_attn.q_proj")]:
        for names in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            parts = [modules.get(f"{path}.{name}") for name in names]
            if all(isinstance(part, BlockLinear) for part in parts):
                fuse(parts)  # (the parts now view slices of its buffers; the fused layer itself is not kept)


def _matrix(weights: Weights, gguf: GGUFFile, place: Placement, bias_place: Placement | None, tied: bool) -> None:
    info, path = place.tensor, place.target
    if path == "model.embed_tokens" and not tied:
        weights.modules[path] = _embedding(gguf, info)
        return
    order = row_order(gguf, path, info.rows_cols[0])
    if info.type_name in FLOATS:  # a float matrix stays a float32 nn.Linear
        weight = torch.from_numpy(np.array(gguf.floats(info.name)))
        if order is not None:  # (llama's query and key rows, as for the quantized ones)
            weight = weight[torch.from_numpy(order)]
        if path == "model.embed_tokens":
            weights.state["model.embed_tokens.weight"] = weights.state["lm_head.weight"] = weight
        else:
            weights.state[f"{path}.weight"] = weight
        return
    bias = None if bias_place is None else torch.from_numpy(np.array(gguf.floats(bias_place.tensor.name)))
    layer = repacked(info, gguf.data(info.name), order, bias)  # (a float matrix's bias is in the state already)
    if path == "model.embed_tokens":  # tied: the head's codes serve both
        weights.modules["lm_head"] = layer
        weights.modules[path] = TiedEmbedding(layer)
    else:
        weights.modules[path] = layer


def _expert_matrices(gguf: GGUFFile, info: TensorInfo) -> list[nn.Module]:
    """A stacked expert tensor [experts, rows, columns] as one matrix per expert, each repacked
    from its own bytes (an expert's rows are contiguous in the file)."""
    count, (rows, cols) = int(np.prod(info.shape[2:])), info.rows_cols
    if info.type_name in FLOATS:  # (float experts: the kernels' float32 layout, so the C table runs them)
        return [BlockLinear.from_float(torch.from_numpy(np.ascontiguousarray(weight)))
                for weight in gguf.floats(info.name)]
    per_expert, data = info.nbytes // count, gguf.data(info.name)
    return [repacked(TensorInfo(f"{info.name}[{e}]", info.type_name, (cols, rows), info.offset + e * per_expert,
                                per_expert), data[e * per_expert:(e + 1) * per_expert])
            for e in range(count)]


def _embedding(gguf: GGUFFile, info: TensorInfo) -> nn.Module:
    """An untied input embedding: the file's own rows, looked up in the mapping."""
    rows, cols = info.rows_cols
    if info.type_name == "BF16":
        table = torch.from_numpy(np.array(gguf.floats(info.name)))
        return nn.Embedding.from_pretrained(table, freeze=True)
    blocks = torch.from_numpy(gguf.data(info.name).reshape(rows, -1))
    return QuantizedEmbedding(blocks, info.type_name, cols)


def row_order(gguf: GGUFFile, path: str, rows: int) -> np.ndarray | None:
    """llama.cpp stores a llama model's query and key rows permuted for its rotary layout;
    transformers' modules expect them back in order (as its own GGUF loader does for files
    of architecture llama)."""
    if not ARCHITECTURES[gguf.architecture].rows_permuted or not path.endswith(("q_proj", "k_proj")):
        return None
    heads = gguf.field("attention.head_count")
    if path.endswith("k_proj"):
        heads = gguf.field("attention.head_count_kv", heads)
    if not isinstance(heads, (int, np.integer)) or heads <= 0 or rows % (2 * heads):
        raise GGUFError(f"{gguf.path.name}: {rows} query/key rows cannot be split into {heads} heads")
    half = rows // heads // 2
    return np.arange(rows).reshape(int(heads), half, 2).swapaxes(2, 1).reshape(rows)


def release(gguf: GGUFFile, info: TensorInfo) -> None:
    """Drop the mapping's pages of a tensor already copied into its layer (a private mapping
    reads them again from the file if ever touched), so the load's peak memory is the
    model's, not the model's plus the file's."""
    mapping, page = gguf._map, mmap.PAGESIZE
    start = -(-info.offset // page) * page  # (only pages the tensor fills: they hold no other tensor's bytes)
    length = (info.offset + info.nbytes) // page * page - start
    if mapping is not None and length > 0 and hasattr(mapping, "madvise"):
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            pass


class WeightsAhead:
    """`build_weights` of `places` on a thread of its own, started at once; `result()` waits for it,
    `cancel()` stops it after the tensor at hand (both join the thread, so nothing still
    reads the mapping when they return)."""

    def __init__(self, gguf: GGUFFile, places: list[Placement], tied: bool, progress: Progress | None = None):
        self.places = places
        self._stop = threading.Event()
        self._weights: Weights | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, args=(gguf, places, tied, progress),
                                        name="specdraft-weights", daemon=True)
        self._thread.start()

    def _build(self, gguf: GGUFFile, places: list[Placement], tied: bool, progress: Progress | None) -> None:
        try:
            self._weights = build_weights(gguf, places, tied, progress, self._stop.is_set)
        except BaseException as exc:  # handed to the thread that waits for the weights
            self._error = exc

    def result(self) -> Weights:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._weights is not None
        weights, self._weights = self._weights, None  # (handed over once: the model holds them next)
        return weights

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()
        self._weights = None
