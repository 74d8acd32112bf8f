"""Weight-only int8 and int4 linear layers for drafters on CPU, on torch's own kernels.

A drafter's forward on a CPU streams every weight from memory once per token, so its cost
is its weight bytes: int8 weights are a quarter of float32, int4 an eighth. torch ships
fused CPU kernels that read the packed weights and multiply in bfloat16
(`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`); activations are cast to
bfloat16 around each layer and back, so the rest of the model keeps its dtype.

Why not torchao: its eager int8 weight-only layer dequantizes and then multiplies, which
reads more bytes than the float32 layer it replaces and so runs slower, and its int4 layout
needs a package that is not on PyPI for every CPU.

Only drafters are meant to be quantized: the target decides the output, and a quantized
target decides a different output (still what that quantized model would say).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("specdraft")

INT4_GROUP = 32  # columns sharing one scale and zero point; the kernel takes 32..256, smaller is more exact
_COMPUTE = torch.bfloat16  # the kernels' activation dtype (float32 activations take a far slower path)


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 rows and one scale per output row (symmetric)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        # The kernel multiplies by the bfloat16 scale: codes are computed against that one.
        scales = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(_COMPUTE).float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(_COMPUTE))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_COMPUTE)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]


class Int4Linear(nn.Module):
    """W in 4 bits per weight, asymmetric, one (scale, zero) per INT4_GROUP columns of a row."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        grouped = weight.reshape(self.out_features, -1, group)
        low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        # The kernel dequantizes (code - 8) * scale + zero, zero being the value of code 8, with
        # scale and zero in bfloat16: codes are computed against those rounded values.
        scale = ((high - low).clamp_min(1e-12) / 15.0).to(_COMPUTE).float()
        zero = (low + 8.0 * scale).to(_COMPUTE).float()
        codes = torch.round((grouped - zero) / scale + 8.0).clamp(0, 15).to(torch.int32).reshape(self.out_features, -1)
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_zeros", torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1)
                             .transpose(0, 1).contiguous().to(_COMPUTE))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @staticmethod
    def fits(linear: nn.Linear, group: int = INT4_GROUP) -> bool:
        return linear.out_features % 16 == 0 and linear.in_features % group == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_COMPUTE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4, self.group,
                                                         self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, bits: int) -> int:
    """Replace every nn.Linear of `model` (its output head included: it is the largest layer
    of a small model) by its int8 or int4 form, in place; returns how many were replaced.
    A tied head gets its own quantized copy; the input embedding stays as it was (a lookup
    reads one row per token, so quantizing it would save memory, not time). Layers whose
    shape the int4 kernel cannot take stay in floating point."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    replaced, kept = 0, 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if bits == 4 and not Int4Linear.fits(child):
                kept += 1
                continue
            setattr(parent, name, Int8Linear(child) if bits == 8 else Int4Linear(child))
            replaced += 1
    if kept:
        log.info("int4: %d linear layers have shapes the kernel cannot take and stay in floating point", kept)
    if getattr(model.config, "tie_word_embeddings", False):
        # transformers would re-tie the (now quantized) head to the embedding on some calls
        model.config.tie_word_embeddings = False
    return replaced
