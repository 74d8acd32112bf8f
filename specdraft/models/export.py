"""A profile's target written as a plain transformers folder that serving engines load as is
(vLLM, transformers, TGI): `specdraft export`.

A GGUF target is dequantized (transformers' reading of the file, the same float weights
specdraft's float path runs); a package file or folder loads as specdraft loads it. The
folder then holds what such engines read: `config.json` naming the architecture, without
the GGUF `quantization_config` transformers attaches while reading a GGUF file (an engine
would try to load GGUF blocks that are not there), with `tie_word_embeddings` as the model
has it; the weights as safetensors in the chosen dtype, a tied embedding stored under the
embedding's own name (the name engines read; transformers drops the head's copy); the
tokenizer with its chat template, and the generation config. Written through a staging
folder: a kill leaves the old folder or the new one, never a half-written one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specdraft.config.model_spec import ModelSpec
from specdraft.storage import atomic_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(spec: ModelSpec, file: str, key: str, out: Path, dtype: str) -> Path:
    """Write the model of `spec` (a profile's `key`, e.g. "target") to the folder `out` in
    `dtype`. Returns `out`."""
    from specdraft.models.loading import load_model

    # float32 on the CPU: the float weights as they are (bfloat16 there would move the
    # matrices onto specdraft's own kernels, which no engine reads), cast when saving.
    plain = dataclasses.replace(spec, quantization="none", dtype="float32", device="cpu")
    loaded = load_model(plain, file, key)
    model = loaded.model.to(DTYPES[dtype])
    config = model.config
    config.architectures = [type(model).__name__]
    for stale in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, stale):
            delattr(config, stale)
    # transformers keeps the GGUF reader's quantizer on a model read from a GGUF file (its
    # weights are dequantized floats by then) and refuses to save such a model.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    config.dtype = dtype
    _tie_as_declared(model)
    with atomic_files.staged_folder(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        loaded.tokenizer.save_pretrained(staging)
        for saved in staging.iterdir():  # safetensors writes 0600: an engine may run as another user
            saved.chmod(atomic_files.new_file_mode())
    return out


def _tie_as_declared(model: torch.nn.Module) -> None:
    """The config says tied exactly when the head and the embedding are one matrix, and then
    they are one tensor: the saved file holds it once, under the embedding's name, and a
    loader that reads the config restores the head from it. (A head sharing the embedding's
    tensor under a config that says untied would be saved once and loaded back random.)"""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return
    shared = head.weight.data_ptr() == embedding.weight.data_ptr()
    same = shared or (head.weight.shape == embedding.weight.shape and torch.equal(head.weight, embedding.weight))
    tied = same and (shared or getattr(model.config, "tie_word_embeddings", False))
    model.config.tie_word_embeddings = tied
    if tied and not shared:
        head.weight = embedding.weight
