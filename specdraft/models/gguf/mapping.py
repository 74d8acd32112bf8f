"""A GGUF model built from its mapped file, as llama.cpp loads one: every quantized matrix is
repacked into the block products' layout as it is read (repack.py, in C), an untied
embedding is looked up from the file's own blocks in the mapping (nothing copied), and only
norms and biases are copied, as float32. Nothing goes through a float32 copy of the model, so
loading needs about the model's own memory, and a model that cannot fit is refused before
anything large is allocated (`check_memory`).

The module tree is transformers' (built empty from the config), so the lean forward, the
caches and every drafter see the same model they always did. Which file tensor fills which
module is its architecture's entry in architectures.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.kernels.block_linear import BLOCK, BlockLinear
from specdraft.models.kernels.experts import Experts
from specdraft.models.kernels.fused_linear import Concatenated
from specdraft.models.kernels.formats import GROUP
from specdraft.models.gguf.architectures import ARCHITECTURES, GLOBAL_VECTORS
from specdraft.models.gguf.file import GGUFError, GGUFFile, TensorInfo
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding, ScaledEmbedding, TiedEmbedding
from specdraft.models.gguf.repack import TYPE_NUMBERS, repacked
from specdraft.models.kernels.native import library

log = logging.getLogger("specdraft")

_FLOATS = ("F32", "F16", "BF16")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True)
class Placement:
    """Where one file tensor goes: a matrix (module path), or a float tensor (parameter name)."""

    tensor: TensorInfo
    target: str
    matrix: bool
    expert: str | None = None  # a stacked expert tensor: which matrix of each expert (target: the experts)


def placements(gguf: GGUFFile) -> list[Placement]:
    """Every tensor of the file and where it goes (its architecture's entry,
    architectures.py); a tensor the entry does not know is an error."""
    found, architecture = [], ARCHITECTURES[gguf.architecture]
    for info in gguf.tensors.values():
        name = info.name
        layer = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if name == "token_embd.weight":
            found.append(Placement(info, "model.embed_tokens", True))
        elif name == "output.weight":
            found.append(Placement(info, "lm_head", True))
        elif name in GLOBAL_VECTORS:
            found.append(Placement(info, GLOBAL_VECTORS[name], False))
        elif layer and layer.group(2) in architecture.expert_matrices and layer.group(3) == "weight":
            found.append(Placement(info, f"model.layers.{layer.group(1)}.mlp.experts", True,
                                   architecture.expert_matrices[layer.group(2)]))
        elif layer and layer.group(2) in architecture.layer_matrices:
            path = f"model.layers.{layer.group(1)}.{architecture.layer_matrices[layer.group(2)]}"
            weight = layer.group(3) == "weight"
            found.append(Placement(info, path if weight else f"{path}.bias", weight))
        elif layer and f"{layer.group(2)}.{layer.group(3)}" in architecture.layer_vectors:
            found.append(Placement(info, f"model.layers.{layer.group(1)}."
                                         f"{architecture.layer_vectors[layer.group(2) + '.' + layer.group(3)]}", False))
        elif name not in architecture.ignored:
            raise GGUFError(f"{gguf.path.name}: tensor {name} has no place in a {gguf.architecture} model")
    return found


def resident_bytes(places: list[Placement], tied: bool) -> int:
    """The bytes the loaded model holds (its repacked matrices and float tensors; an untied
    quantized embedding stays in the file's mapping and counts nothing)."""
    total = 0
    for place in places:
        info = place.tensor
        rows, cols = info.rows_cols
        rows *= int(np.prod(info.shape[2:]))  # (a stacked expert tensor: every expert's rows)
        if not place.matrix or info.type_name in _FLOATS:
            total += rows * cols * 4
        elif place.target == "model.embed_tokens" and not tied:
            continue
        else:
            bits = library().repack_bits(TYPE_NUMBERS[info.type_name])
            terms = library().repack_terms(TYPE_NUMBERS[info.type_name])
            groups, blocks = cols // GROUP * max(terms, 1), -(-rows // BLOCK)
            per_group = {4: 256 + 2 * 20, 6: 384 + 36}.get(bits, 512 + BLOCK * 4)  # codes and scales, in bytes
            total += blocks * groups * per_group
    return total


def available_bytes() -> int | None:
    """Memory this process may still use: SPECDRAFT_MEMORY_LIMIT (bytes, or with a K/M/G
    suffix) when set, else the kernel's MemAvailable, lowered by a cgroup limit if any."""
    limit = os.environ.get("SPECDRAFT_MEMORY_LIMIT")
    if limit:
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(float(limit[:-1]) * units[limit[-1].upper()]) if limit[-1].upper() in units else int(limit)
        except ValueError:
            raise SpecdraftError(f"SPECDRAFT_MEMORY_LIMIT={limit!r} is not a number of bytes (e.g. 8G)") from None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if text != "max":
            found.append(int(text) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory(name: str, needed: int) -> None:
    """Refuse, in one line, a model whose weights would not fit in the memory left."""
    available = available_bytes()
    if available is not None and needed > available:
        raise SpecdraftError(f"{name} needs {needed / 2**30:.1f} GiB of memory for its weights, but only "
                             f"{max(available, 0) / 2**30:.1f} GiB is available: close other programs or use a "
                             f"smaller quantization of the model")


def mapped_model(gguf: GGUFFile, config: Any, progress: Progress | None = None) -> nn.Module:
    """The model of `gguf` on its file's own quantization, built from the mapping."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    if gguf.architecture not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path.name}: architecture {gguf.architecture} is not mapped "
                        f"({', '.join(ARCHITECTURES)} are)")
    places = placements(gguf)
    ARCHITECTURES[gguf.architecture].configure(config, gguf.field)
    tied = "output.weight" not in gguf.tensors
    check_memory(gguf.path.name, resident_bytes(places, tied))
    config.tie_word_embeddings = False  # two modules: transformers must not tie them again
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_model_config(config)
    _check_shapes(model, gguf, places)
    _fill(model, gguf, places, tied, progress)
    _scale_rotary_frequencies(model, gguf)
    missing = [name for name, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise GGUFError(f"{gguf.path.name} has no tensor for {len(missing)} of the model's weights "
                        f"(first: {missing[0]})")
    return model.eval()


def _scale_rotary_frequencies(model: nn.Module, gguf: GGUFFile) -> None:
    """Llama 3.1+'s rope scaling as llama.cpp's files carry it: `rope_freqs.weight`, a factor
    per rotary frequency that divides it (transformers' reader builds the config without it)."""
    info = gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return
    rotary = model.model.rotary_emb
    factors = torch.from_numpy(np.array(gguf.floats(info.name))).float().reshape(-1)
    if factors.shape != rotary.inv_freq.shape or not bool(torch.isfinite(factors).all() and (factors > 0).all()):
        raise GGUFError(f"{gguf.path.name}: rope_freqs.weight holds {factors.numel()} factors; its "
                        f"{rotary.inv_freq.numel()} rotary frequencies need as many, finite and positive")
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq


def _check_shapes(model: nn.Module, gguf: GGUFFile, places: list[Placement]) -> None:
    """Every tensor of the file has the shape its header's sizes give its module (checked on
    the empty model, before anything is read or repacked)."""
    for place in places:
        info = place.tensor
        try:
            expected = _expected_expert_shape(model, place) if place.expert else \
                tuple((model.get_submodule(place.target).weight if place.matrix
                       else model.get_parameter(place.target)).shape)
        except AttributeError:
            continue  # a tensor the model has no parameter for is reported as missing or left out
        found = tuple(reversed(info.shape)) if place.expert or not place.matrix else info.rows_cols
        if len(expected) == 1:
            found = (int(np.prod(info.shape)),)
        if tuple(found) != expected:
            raise GGUFError(f"{gguf.path.name}: tensor {info.name} is {'x'.join(map(str, found))}, but the "
                            f"header's sizes make it {'x'.join(map(str, expected))}")


def _expected_expert_shape(model: nn.Module, place: Placement) -> tuple[int, ...]:
    """The shape [experts, rows, columns] transformers' experts module gives a stacked tensor."""
    experts = model.get_submodule(place.target)
    if place.expert == "down":
        return tuple(experts.down_proj.shape)
    count, gate_up, hidden = experts.gate_up_proj.shape
    return count, gate_up // 2, hidden


def _fill(model: nn.Module, gguf: GGUFFile, places: list[Placement], tied: bool, progress: Progress | None) -> None:
    floats = {place.target: place for place in places if not place.matrix}
    norm_offset = ARCHITECTURES[gguf.architecture].norm_offset
    total, done = sum(place.tensor.nbytes for place in places), 0
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, list[nn.Module]]] = {}  # experts module path -> {gate/up/down: per expert}
    for place in places:
        info = place.tensor
        if place.expert:
            experts.setdefault(place.target, {})[place.expert] = _expert_matrices(gguf, info)
        elif place.matrix:
            _place_matrix(model, gguf, place, floats, tied, state)
        else:
            state[place.target] = torch.from_numpy(np.array(gguf.floats(info.name)))  # a copy: pages are released
            if norm_offset and place.target.endswith("norm.weight"):
                state[place.target] -= norm_offset
        if not (place.target == "model.embed_tokens" and not tied):
            _release(gguf, info)  # its pages are in the layer now: the mapping need not hold them
        done += info.nbytes
        if progress is not None:
            progress(done, total)
    for path, kinds in experts.items():
        if set(kinds) != {"gate", "up", "down"}:
            raise GGUFError(f"{gguf.path.name}: the experts of {path} lack {', '.join({'gate', 'up', 'down'} - set(kinds))}")
        # (side by side, not fused: a copy per expert would fragment the heap a large model loads into)
        gate_up = [Concatenated([gate, up]) for gate, up in zip(kinds["gate"], kinds["up"])]
        model.set_submodule(path, Experts(gate_up, kinds["down"]))
    biases = {f"{path}.bias" for path, m in model.named_modules() if isinstance(m, BlockLinear)}
    model.load_state_dict({k: v for k, v in state.items() if k not in biases}, strict=False, assign=True)
    if ARCHITECTURES[gguf.architecture].scaled_embedding and not hasattr(model.model.embed_tokens, "embed_scale"):
        model.model.embed_tokens = ScaledEmbedding(model.model.embed_tokens, model.config.hidden_size ** 0.5)


def _place_matrix(model: nn.Module, gguf: GGUFFile, place: Placement, floats: dict, tied: bool,
                  state: dict[str, torch.Tensor]) -> None:
    info, path = place.tensor, place.target
    bias_place = floats.get(f"{path}.bias")
    bias = None if bias_place is None else torch.from_numpy(np.array(gguf.floats(bias_place.tensor.name)))
    if path == "model.embed_tokens" and not tied:
        model.set_submodule(path, _embedding(gguf, info, model.config.hidden_size))
        return
    order = _row_order(gguf, path, info.rows_cols[0])
    if info.type_name in _FLOATS:  # a float matrix stays a float32 nn.Linear
        weight = torch.from_numpy(np.array(gguf.floats(info.name)))
        if order is not None:  # (llama's query and key rows, as for the quantized ones)
            weight = weight[torch.from_numpy(order)]
        if path == "model.embed_tokens":
            state["model.embed_tokens.weight"] = state["lm_head.weight"] = weight
        else:
            state[f"{path}.weight"] = weight
            if bias is not None:
                state[f"{path}.bias"] = bias
        return
    layer = repacked(info, gguf.data(info.name), order, bias)
    if path == "model.embed_tokens":  # tied: the head's codes serve both
        model.set_submodule("lm_head", layer)
        model.set_submodule(path, TiedEmbedding(layer))
    else:
        model.set_submodule(path, layer)


def _expert_matrices(gguf: GGUFFile, info: TensorInfo) -> list[nn.Module]:
    """A stacked expert tensor [experts, rows, columns] as one matrix per expert, each repacked
    from its own bytes (an expert's rows are contiguous in the file)."""
    count, (rows, cols) = int(np.prod(info.shape[2:])), info.rows_cols
    if info.type_name in _FLOATS:  # (float experts: the kernels' float32 layout, so the C table runs them)
        return [BlockLinear.from_float(torch.from_numpy(np.ascontiguousarray(weight)))
                for weight in gguf.floats(info.name)]
    per_expert, data = info.nbytes // count, gguf.data(info.name)
    return [repacked(TensorInfo(f"{info.name}[{e}]", info.type_name, (cols, rows), info.offset + e * per_expert,
                                per_expert), data[e * per_expert:(e + 1) * per_expert])
            for e in range(count)]


def _embedding(gguf: GGUFFile, info: TensorInfo, dim: int) -> nn.Module:
    """An untied input embedding: the file's own rows, looked up in the mapping."""
    rows, cols = info.rows_cols
    if info.type_name == "BF16" or cols != dim:
        table = torch.from_numpy(np.array(gguf.floats(info.name)))
        return nn.Embedding.from_pretrained(table, freeze=True)
    blocks = torch.from_numpy(gguf.data(info.name).reshape(rows, -1))
    return QuantizedEmbedding(blocks, info.type_name, dim)


def _row_order(gguf: GGUFFile, path: str, rows: int) -> np.ndarray | None:
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


def _release(gguf: GGUFFile, info: TensorInfo) -> None:
    """Drop the mapping's pages of a tensor already copied into its layer (a private mapping
    reads them again from the file if ever touched), so the load's peak memory is the
    model's, not the model's plus the file's."""
    mapping = gguf._map
    if mapping is None or not hasattr(mapping, "madvise"):
        return
    page = mmap.PAGESIZE
    start = -(-info.offset // page) * page
    end = (info.offset + info.nbytes) // page * page
    if end > start:
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass
