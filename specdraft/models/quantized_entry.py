"""The cache entry of a GGUF model on its file's own quantization: what runs, and nothing else.

`save_entry` writes the kernel's codes, scales and offsets, the embedding's raw blocks and
the model's remaining float tensors to one safetensors file; `load_entry` builds the model
around them without allocating float weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdraft.models.block_linear import BlockLinear, kernel_layout
from specdraft.models.file_quantization import FileCodes
from specdraft.models.gguf_blocks import Int8Codes
from specdraft.models.quantized_embedding import QuantizedEmbedding, TiedEmbedding

WEIGHTS_FILE = "quantized.safetensors"
FORMAT = "specdraft-file-quantization-3"


def save_entry(model: nn.Module, codes: FileCodes, folder: Path) -> None:
    """Write the kernel layouts, the embedding's blocks and the model's remaining float
    tensors to `folder`/WEIGHTS_FILE."""
    from safetensors.torch import save_file

    tensors, layout = _matrix_tensors(codes)
    embedding = None
    if codes.tied:
        embedding = {"tied": True}
    elif codes.embedding is not None:
        type_name, blocks = codes.embedding
        tensors["model.embed_tokens.blocks"] = torch.from_numpy(blocks.copy())  # the reader's memory map is read-only
        embedding = {"type": type_name, "dim": int(model.config.hidden_size)}
    replaced = {f"{path}.weight" for path in layout}
    if embedding is not None:
        replaced.add("model.embed_tokens.weight")
    for name, tensor in model.state_dict().items():
        if name not in replaced and name not in tensors:
            tensors[name] = tensor.detach().float().clone()
    metadata = {"format": FORMAT, "layout": json.dumps(layout), "embedding": json.dumps(embedding)}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata=metadata)


def _matrix_tensors(codes: FileCodes) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The stored tensors of every quantized matrix (codes, scales, offsets by module path)
    and each one's layout."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for path, weights in codes.matrices.items():
        target = "lm_head" if codes.tied and path == "model.embed_tokens" else path
        if isinstance(weights, Int8Codes):
            tensors[f"{target}.codes"] = torch.from_numpy(weights.codes)
            tensors[f"{target}.scales"] = torch.from_numpy(weights.scales)
            layout[target] = {"bits": 8}
            continue
        kernel_codes, scales, offsets = kernel_layout(weights)
        tensors[f"{target}.codes"] = torch.from_numpy(kernel_codes)
        tensors[f"{target}.scales"] = torch.from_numpy(scales)
        tensors[f"{target}.offsets"] = torch.from_numpy(offsets)
        layout[target] = {"bits": 4, "terms": len(weights.codes)}
    return tensors, layout


def load_entry(folder: Path) -> nn.Module:
    """The model of a cache entry written by `save_entry`, its matrices on their codes."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.tie_word_embeddings = False  # two modules: transformers must not tie them
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
        metadata = weights.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{WEIGHTS_FILE} is not in {FORMAT}")
        layout, embedding = json.loads(metadata["layout"]), json.loads(metadata["embedding"])
        stored = {name: weights.get_tensor(name) for name in weights.keys()}
    for path, entry in layout.items():
        offsets = stored.pop(f"{path}.offsets") if entry["bits"] == 4 else None
        layer = BlockLinear.from_rows(stored.pop(f"{path}.codes"), stored.pop(f"{path}.scales"), offsets,
                                      entry.get("terms", 1), stored.pop(f"{path}.bias", None))
        model.set_submodule(path, layer)
    if embedding is not None and embedding.get("tied"):
        model.set_submodule("model.embed_tokens", TiedEmbedding(model.lm_head))
    elif embedding is not None:
        model.set_submodule("model.embed_tokens", QuantizedEmbedding(stored.pop("model.embed_tokens.blocks"),
                                                                     embedding["type"], embedding["dim"]))
    model.load_state_dict(stored, strict=False, assign=True)
    missing = [name for name, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{len(missing)} tensors were not in the cache entry (first: {missing[0]})")
    return model.eval()
