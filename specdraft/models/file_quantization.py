"""A GGUF model kept on its file's own quantization (`quantization = "gguf"`, the default for
a .gguf model on a CPU).

A decode step streams every weight once, so a Q4 file dequantized into float32 costs five
to eight times its bytes per step. Here every quantized matrix of the file keeps its block
codes and scales (gguf_blocks.py: exact sums of 4-bit terms for Q4_0/Q4_1/Q4_K/Q5_*, int8
groups for Q8_0, int8 rows for the rest) and runs on specdraft's block kernels
(block_linear.py); norms, biases, the residual stream, attention and the KV cache stay in
float32. The input embedding keeps the file's own blocks and dequantizes only the rows it
looks up (or, tied to the head, reads them from the head's codes).

Conversion reads the file twice: transformers dequantizes it (which gives the config, the
tokenizer, the float tensors and, for every matrix, the reference its codes are checked
against: a mismatch, e.g. a permutation this module does not know, falls back to int8 rows
of transformers' weight with a warning), and `gguf` reads the raw blocks. What is cached is
what runs (quantized_entry.py); the embedding modules are in quantized_embedding.py, the
header read that decides whether a file runs here in gguf_header.py.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdraft.config.model_spec import ModelSpec
from specdraft.errors import ProfileError
from specdraft.models.block_linear import BlockLinear
from specdraft.models.gguf_blocks import EXACT_TYPES, GROUP, Int4Terms, Int8Codes, block_terms, int8_rows
from specdraft.models.gguf_header import gguf_architecture
from specdraft.models.native import kernel_problem
from specdraft.models.quantized_embedding import QuantizedEmbedding, TiedEmbedding

log = logging.getLogger("specdraft")

ARCHITECTURES = ("llama", "qwen2", "mistral")  # whose GGUF tensor names are mapped below
# GGUF's names of a decoder layer's matrices -> transformers' module paths inside the layer
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOLERANCE = 1e-5  # relative to a matrix's largest weight: float32 rounding of the reference, nothing more


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


def read_file_codes(gguf: Path, model: nn.Module) -> FileCodes:
    """The codes of every quantized matrix of `gguf`, in transformers' row order and checked
    against `model`'s (transformers' dequantized) weights."""
    from gguf import GGUFReader

    config = model.config
    modules = dict(model.named_modules())
    found = FileCodes()
    for tensor in GGUFReader(str(gguf)).tensors:
        path = _module_path(tensor.name)
        if path is None or len(tensor.shape) != 2 or path not in modules:
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions innermost first
        type_name = tensor.tensor_type.name
        reference = _weight_of(modules[path])
        if reference is None or tuple(reference.shape) != shape or shape[1] % GROUP:
            continue
        codes = block_terms(type_name, tensor.data, shape)
        if codes is None:
            continue  # a float tensor in the file: it stays float
        if path == "model.embed_tokens":
            found.embedding = (type_name, np.ascontiguousarray(tensor.data).reshape(shape[0], -1).view(np.uint8))
        order = _row_order(config, path, shape[0])
        if order is not None:
            codes = codes.rows(order)
        if not reproduces(codes, reference, exact=type_name in EXACT_TYPES):
            log.warning("%s: the file's %s codes do not reproduce transformers' weight; it runs on int8 rows "
                        "of that weight instead", path, type_name)
            codes = int8_rows(reference.float().numpy())
        found.matrices[path] = codes
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    found.tied = "lm_head" not in found.matrices and "model.embed_tokens" in found.matrices \
        and head is not None and head.weight.data_ptr() == embedding.weight.data_ptr()
    if not found.tied:
        found.matrices.pop("model.embed_tokens", None)  # looked up from its blocks, never multiplied
    return found


def _module_path(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens"
    if name == "output.weight":
        return "lm_head"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _row_order(config: Any, path: str, rows: int) -> np.ndarray | None:
    """llama.cpp stores a llama model's query and key rows permuted for its rotary layout;
    transformers undoes it on load (the same permutation here, applied to row indices)."""
    if config.model_type != "llama" or not path.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_attention_heads if path.endswith("q_proj") else config.num_key_value_heads
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(2, 1).reshape(rows)


def _weight_of(module: nn.Module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    return weight.detach() if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def reproduces(codes: Int4Terms | Int8Codes, reference: torch.Tensor, exact: bool, chunk: int = 8192) -> bool:
    """Whether the codes reproduce `reference` [N, K]: to float32 rounding when they were
    read exactly, within half an int8 step of each row when they were rounded to int8 rows
    (in row chunks: a large vocabulary's table in float64 would be gigabytes)."""
    expected = reference.float().numpy()
    for start in range(0, codes.shape[0], chunk):
        rows = np.arange(start, min(start + chunk, codes.shape[0]))
        error = np.abs(codes.rows(rows).dense() - expected[rows])
        largest = np.abs(expected[rows]).max(axis=1, keepdims=True)
        if exact and error.max() > _TOLERANCE * max(float(largest.max()), 1e-30):
            return False
        if not exact and np.any(error > largest / 254.0 * (1 + _TOLERANCE) + 1e-30):
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
