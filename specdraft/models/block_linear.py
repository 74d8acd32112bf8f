"""Linear layers on 4-bit weight groups, multiplied by specdraft's own CPU kernel.

torch's int4/int8 weight-only kernels (`quantize.py`) dequantize every weight again for
each row of activations, so on an AVX2 CPU a product over 11 rows costs about five times
one row, and even one row runs far below the memory bandwidth. A verify over K + 1 tokens
must cost little more than one token, or speculation gains nothing. `block_kernel.c` works
as llama.cpp's CPU backend does: the activations are quantized to int8 per row and group of
32, and each weight group's codes, expanded once, meet every row in integer dot products
(AVX2 `maddubs`). It is width-invariant by construction (see cpu_kernels.c): each row's
result is bit for bit the same whatever the number of rows, which is what lossless
speculation on the quantized target needs. native.py builds and loads it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdraft.models.gguf_blocks import GROUP, Int4Terms, Int8Codes
from specdraft.models.native import library


def kernel_layout(terms: Int4Terms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, G * 16] uint8, scales [N, G], offsets [N, G] float32) as the kernel reads
    them: G = terms x K / 32 groups, byte j of a group holding codes j and j + 16."""
    wide = np.concatenate(terms.codes, axis=1)
    rows = wide.shape[0]
    grouped = wide.reshape(rows, -1, GROUP).astype(np.uint8)
    codes = (grouped[..., :16] | (grouped[..., 16:] << 4)).reshape(rows, -1)
    scales = np.concatenate(terms.scales, axis=1).astype(np.float32)
    offsets = np.concatenate(terms.offsets, axis=1).astype(np.float32)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales), np.ascontiguousarray(offsets)


class BlockLinear(nn.Module):
    """y = x W^T + b on the block kernel: W a sum of `terms` 4-bit group weights over x
    (`bits` = 4: codes [N, G * 16], scales and offsets [N, G]), or int8 codes with a scale
    per group (`bits` = 8: codes [N, K], scales [N, K / 32], no offsets)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, terms: int = 1,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.bits = 4 if offsets is not None else 8
        self.out_features, groups = scales.shape
        self.terms, self.in_features = terms, groups // terms * GROUP
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("offsets", offsets.float().contiguous() if offsets is not None else torch.zeros(0))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        kernels = library()
        self._matmul = kernels.block_matmul if self.bits == 4 else kernels.block_matmul8
        self._pointers()

    @classmethod
    def of(cls, weights: Int4Terms | Int8Codes, bias: torch.Tensor | None = None) -> "BlockLinear":
        if isinstance(weights, Int8Codes):
            return cls(torch.from_numpy(weights.codes), torch.from_numpy(weights.scales), None, 1, bias)
        codes, scales, offsets = kernel_layout(weights)
        return cls(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets), len(weights.codes),
                   bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            return self.forward(x.float().contiguous()).to(x.dtype)
        rows = x.numel() // self.in_features
        out = torch.empty(*x.shape[:-1], self.out_features)  # [..., N]
        if self.bits == 8:
            status = self._matmul(x.data_ptr(), rows, self.in_features, self._codes, self._scales, self.out_features,
                                  out.data_ptr(), torch.get_num_threads())
        else:
            status = self._matmul(x.data_ptr(), rows, self.in_features, self._codes, self._scales, self._offsets,
                                  self.out_features, self.groups, out.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        if self.bias is not None:
            out += self.bias
        return out

    def _apply(self, fn, recurse=True):  # buffers moved or re-pointed: the cached addresses follow
        result = super()._apply(fn, recurse)
        self._pointers()
        return result

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("codes", "scales", "offsets") and all(hasattr(self, n) for n in ("codes", "scales", "offsets")):
            self._pointers()

    def _pointers(self) -> None:
        """The buffers' addresses, read once (a step calls this layer a hundred times)."""
        self.groups = self.scales.shape[1]
        self._codes, self._scales, self._offsets = (self.codes.data_ptr(), self.scales.data_ptr(),
                                                    self.offsets.data_ptr())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of W dequantized [n, K] float32, exactly as the kernel's weights (a
        tied embedding looks its rows up here instead of keeping a second copy)."""
        if self.bits == 8:
            codes = self.codes.index_select(0, ids).view(len(ids), -1, GROUP).float()  # [n, G, 32]
            return (codes * self.scales.index_select(0, ids)[..., None]).view(len(ids), self.in_features)
        packed = self.codes.index_select(0, ids).view(len(ids), -1, 16)  # [n, G, 16]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # [n, G, 32]
        values = codes * self.scales.index_select(0, ids)[..., None] + self.offsets.index_select(0, ids)[..., None]
        return values.view(len(ids), self.terms, self.in_features).sum(1)

    @property
    def weight(self) -> torch.Tensor:
        """W dequantized [N, K] (a fresh tensor, for one-off readers such as a draft head's
        readout, never for a step)."""
        return self.rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        form = f"terms={self.terms}" if self.bits == 4 else "int8"
        return f"in_features={self.in_features}, out_features={self.out_features}, {form}"


def runs_on_file_quantization(model: nn.Module) -> bool:
    """Whether `model`'s matrices run on the block kernel (a GGUF model on its own quantization)."""
    return any(isinstance(module, BlockLinear) for module in model.modules())
