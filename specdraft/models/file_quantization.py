"""A GGUF model kept on its file's own quantization (`quantization = "gguf"`, the default for
a .gguf model on a CPU).

A decode step streams every weight once, so a Q4 file dequantized into float32 costs five
to eight times its bytes per step. Here every quantized matrix of the file keeps its block
codes and scales (kernels/formats.py: exact sums of 4-bit terms for Q4_0/Q4_1/Q4_K/Q5_*, int8
groups for Q8_0, int8 rows for the rest) and runs on specdraft's block kernels
(block_linear.py); norms, biases, the residual stream, attention and the KV cache stay in
float32. The input embedding keeps the file's own blocks and dequantizes only the rows it
looks up (or, tied to the head, reads them from the head's codes).

This module decides whether a file runs so and puts given codes into a model in memory
(tests build their quantized models with it); a file's model is built from its mapping by
gguf/mapping.py, the embedding modules are in quantized_embedding.py, the header read that
decides whether a file runs here in gguf/header.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdraft.config.model_spec import ModelSpec
from specdraft.errors import ProfileError
from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.formats import Int4Terms, Int8Codes
from specdraft.models.gguf.header import gguf_architecture
from specdraft.models.gguf.architectures import ARCHITECTURES
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.quantized_embedding import QuantizedEmbedding, TiedEmbedding

log = logging.getLogger("specdraft")



@dataclass
class FileCodes:
    """What a GGUF file's quantized matrices run on: kernel terms by module path, and the
    embedding's raw blocks."""

    matrices: dict[str, Int4Terms | Int8Codes] = field(default_factory=dict)
    embedding: tuple[str, np.ndarray] | None = None  # (GGUF type, [V, bytes per row] uint8)
    tied: bool = False  # the head multiplies by the embedding's matrix


def runs_on_file_codes(spec: ModelSpec, gguf: Path, device: torch.device, file: str, key: str) -> bool:
    """Whether the .gguf model `gguf` runs on its file's own codes: asked for (`quantization
    = "gguf"`: refused with a ProfileError where it cannot), or by default on a CPU where
    the kernels run and the architecture is mapped (else a warning says why it is
    dequantized instead); the float parts then run in float32."""
    if spec.quantization not in (None, "gguf"):
        return False
    where = f"{key}.quantization"
    if device.type != "cpu":
        if spec.quantization == "gguf":
            raise ProfileError(file, where, f'"gguf" runs on CPUs; on {device.type} use "4bit" or "8bit" '
                                            "(bitsandbytes) or leave it unset (dequantized)")
        return False
    if spec.dtype not in ("auto", "float32"):
        if spec.quantization == "gguf":
            raise ProfileError(file, f"{key}.dtype", f'quantization = "gguf" runs the float parts in float32, '
                                                     f'not {spec.dtype}; set quantization = "none" for {spec.dtype}')
        return False
    problem = kernel_problem()
    if problem is None:
        architecture = gguf_architecture(gguf)
        if architecture is None and spec.quantization is None:
            return False  # an unreadable file: the float path says what is wrong with it
        if architecture not in ARCHITECTURES:
            problem = f"its architecture ({architecture or 'unreadable'}) is not one whose tensors are mapped " \
                      f"({', '.join(ARCHITECTURES)})"
    if problem is not None:
        if spec.quantization == "gguf":
            raise ProfileError(file, where, f"the file's own quantization cannot run here: {problem}")
        log.warning("%s runs dequantized to float32: its own quantization cannot run here (%s)",
                    spec.describe(), problem)
        return False
    return True


def quantized_in_place(model: nn.Module, codes: FileCodes) -> nn.Module:
    """Replace `model`'s matrices (and embedding) by their kernel forms: the model as the
    cache entry would load it, for a run whose cache cannot be written."""
    for path, weights in codes.matrices.items():
        target = "lm_head" if codes.tied and path == "model.embed_tokens" else path
        bias = getattr(model.get_submodule(target), "bias", None)
        model.set_submodule(target, BlockLinear.of(weights, None if bias is None else bias.detach()))
    if codes.tied:
        model.set_submodule("model.embed_tokens", TiedEmbedding(model.lm_head))
    elif codes.embedding is not None:
        type_name, blocks = codes.embedding
        model.set_submodule("model.embed_tokens",
                            QuantizedEmbedding(torch.from_numpy(blocks.copy()), type_name, model.config.hidden_size))
    model.config.tie_word_embeddings = False  # two modules now: transformers must not re-tie them
    return model.float().eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (each storage counted once)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
