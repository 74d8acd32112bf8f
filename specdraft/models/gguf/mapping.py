"""A GGUF model built from its mapped file, as llama.cpp loads one: which file tensor goes
where (its architecture's entry in architectures.py), whether the weights fit in memory
(`check_memory`, before anything large is allocated), and the model assembled from them.

The weights themselves are built by weights.py (every quantized matrix repacked by C as it is
read, an untied embedding looked up in the mapping, only norms and biases copied as float32;
no float32 copy of the model, so loading needs about the model's own memory), on a thread
started as soon as the header is read (`weights_ahead`). The module tree is transformers'
(built empty from the config), so the lean forward, the caches and every drafter see the same
model they always did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.gguf.architectures import ARCHITECTURES, GLOBAL_VECTORS
from specdraft.models.gguf.file import GGUFError, GGUFFile
from specdraft.models.gguf.repack import TYPE_NUMBERS
from specdraft.models.gguf.weights import FLOATS, MODULES_BUILT, Placement, Progress, WeightsAhead
from specdraft.models.kernels.block_linear import BLOCK
from specdraft.models.kernels.formats import GROUP
from specdraft.models.kernels.native import library
from specdraft.models.kernels.quantized_embedding import ScaledEmbedding

log = logging.getLogger("specdraft")


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
        if not place.matrix or info.type_name in FLOATS:
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


def weights_ahead(gguf: GGUFFile, progress: Progress | None = None) -> WeightsAhead:
    """The model's weights of `gguf`, built on a thread of their own from now on (weights.py),
    once its architecture is known to be mapped and its weights known to fit in memory."""
    if gguf.architecture not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path.name}: architecture {gguf.architecture} is not mapped "
                        f"({', '.join(ARCHITECTURES)} are)")
    places = placements(gguf)
    tied = "output.weight" not in gguf.tensors
    check_memory(gguf.path.name, resident_bytes(places, tied))
    return WeightsAhead(gguf, places, tied, progress)


def mapped_model(gguf: GGUFFile, config: Any, ahead: WeightsAhead) -> nn.Module:
    """The model of `gguf` on its file's own quantization: transformers' module tree for
    `config`, built empty, checked against the file's tensors, then given `ahead`'s weights."""
    from accelerate import init_empty_weights
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, GenerationConfig

    ARCHITECTURES[gguf.architecture].configure(config, gguf.field)
    config.tie_word_embeddings = False  # two modules: transformers must not tie them again
    with contextlib.suppress(KeyError):  # its modeling module imported before the lock is taken
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with MODULES_BUILT, init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_model_config(config)
    _check_shapes(model, gguf, ahead.places)
    weights = ahead.result()
    for path, module in weights.modules.items():
        model.set_submodule(path, module)
    model.load_state_dict(weights.state, strict=False, assign=True)
    if ARCHITECTURES[gguf.architecture].scaled_embedding and not hasattr(model.model.embed_tokens, "embed_scale"):
        model.model.embed_tokens = ScaledEmbedding(model.model.embed_tokens, model.config.hidden_size ** 0.5)
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
