"""Linear layers on 4-bit and 8-bit weight groups, multiplied by specdraft's own CPU kernels.

torch's int4/int8 weight-only kernels (`quantize.py`) dequantize every weight again for
each row of activations, so a verify over K + 1 tokens costs several one-token steps. A
verify must cost little more than one token, or speculation gains nothing. The kernels
(cpu_kernels.c, native.py builds them) work as llama.cpp's repacked CPU GEMMs do: the
activations are quantized to int8 per row and group of 32, the weights are stored with
output columns in vector lanes (blocks of 16 columns, `to_blocks`), and each block's codes,
expanded once, meet every row in integer dot products. They are width-invariant by
construction (cpu_kernels_shared.h): each row's result is bit for bit the same whatever the
number of rows, which is what lossless speculation on the quantized target needs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdraft.models.kernels.boundary import ROW_OUTSIDE, address, check_status
from specdraft.models.kernels.formats import GROUP, Int4Terms, Int8Codes, int8_groups
from specdraft.models.kernels.native import library
from specdraft.models.kernels.scale_forms import FLOAT32, compact, decoded, form_of
from specdraft.models.kernels.structs import ACTIVATIONS_OWN, BLOCK, SIX_GROUP_BYTES, SIX_SCALE_BYTES

__all__ = ["BLOCK", "SIX_GROUP_BYTES", "SIX_SCALE_BYTES", "BlockLinear", "kernel_layout", "to_blocks",
           "to_int8_blocks", "runs_on_file_quantization"]  # (BLOCK and SIX_*: structs.py, kept here for callers)
_GROUP_BYTES = {4: 256, 6: SIX_GROUP_BYTES, 8: 512}  # a group's codes in one block, by bits
# Whether layers built from now on keep their scales in the smallest exact form
# (scale_forms.compact); benchmarks/target_width_cost.py turns it off to time float32 scales.
COMPACT_SCALES = True


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


def to_blocks(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> tuple:
    """A weight's row layout (one output column a row: codes [N, G * 16] packed 4-bit or [N, G *
    32] int8, scales and offsets [N, G]) -> the kernels' block layout (codes [NB, G * 256] or
    [NB, G * 512], scales and offsets [NB, G * 16]; NB = ceil(N / 16), the last block padded
    with zero columns): in each group, chunk k holds bytes 4k..4k+3 of the block's 16 columns."""
    columns, groups = scales.shape
    blocks = -(-columns // BLOCK)
    pad = blocks * BLOCK - columns

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    group_bytes = codes.shape[1] // groups
    coded = padded(codes).view(blocks, BLOCK, groups, group_bytes // 4, 4).permute(0, 2, 3, 1, 4)
    spread = [None if t is None else padded(t).view(blocks, BLOCK, groups).permute(0, 2, 1).reshape(blocks, -1)
              for t in (scales, offsets)]
    return coded.reshape(blocks, -1).contiguous(), spread[0].contiguous(), \
        None if spread[1] is None else spread[1].contiguous()


class BlockLinear(nn.Module):
    """y = x W^T + b on the block kernels: W a sum of `terms` 4-bit group weights over x
    (`bits` = 4), int8 codes with a scale per group (`bits` = 8, no offsets), or bfloat16 /
    float32 weights (`bits` = 16 / 32, no scales: `from_float`), held in the kernels' block
    layout (`to_blocks`); `from_rows` takes the row layout of the quantized ones.

    `activations`: how the activations it meets are rounded to int8 (structs.ACTIVATIONS_*):
    the kernels' own groups by default; a GGUF file's matrix rounds them as llama.cpp does for
    its format (gguf/repack.py), so the file's model is llama.cpp's."""

    activations = ACTIVATIONS_OWN

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, terms: int,
                 bias: torch.Tensor | None, out_features: int, float_inputs: int | None = None,
                 bits: int | None = None):
        """`float_inputs`: K of float weights (codes then hold the weights themselves); `bits`
        6: 6-bit codes with their scale bytes (cpu_kernels_shared.h SIX_*; no offsets)."""
        super().__init__()
        if float_inputs is not None:
            self.bits = {torch.bfloat16: 16, torch.float32: 32}[codes.dtype]
            self.in_features = float_inputs
        elif bits == 6:
            self.bits = 6
            self.in_features = codes.shape[1] // SIX_GROUP_BYTES * GROUP
        else:
            self.bits = 4 if offsets is not None else 8
            self.in_features = codes.shape[1] // _GROUP_BYTES[self.bits] // terms * GROUP
        self.out_features, self.terms = out_features, terms
        self.register_buffer("codes", codes.contiguous())
        if self.bits in (4, 8):
            scales, offsets = compact(scales, offsets, terms, COMPACT_SCALES)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets if offsets is not None else torch.zeros(0))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self._pointers()

    @classmethod
    def from_rows(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, terms: int = 1,
                  bias: torch.Tensor | None = None) -> "BlockLinear":
        """From the row layout (`kernel_layout`'s, or int8 codes [N, K] with scales [N, K / 32])."""
        blocked = to_blocks(codes, scales.float(), None if offsets is None else offsets.float())
        return cls(*blocked, terms, bias, scales.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "BlockLinear":
        """W [N, K] bfloat16 or float32, kept in its dtype (block b holds, for each k, its 16
        columns' weights side by side; the last block padded with zero columns)."""
        columns, inputs = weight.shape
        blocks = -(-columns // BLOCK)
        padded = torch.cat([weight, weight.new_zeros(blocks * BLOCK - columns, inputs)]) if columns % BLOCK else weight
        blocked = padded.detach().view(blocks, BLOCK, inputs).transpose(1, 2).reshape(blocks, inputs * BLOCK)
        return cls(blocked.contiguous(), torch.zeros(0), None, 1, bias, columns, float_inputs=inputs)

    @classmethod
    def of(cls, weights: Int4Terms | Int8Codes, bias: torch.Tensor | None = None) -> "BlockLinear":
        if isinstance(weights, Int8Codes):
            return cls.from_rows(torch.from_numpy(weights.codes), torch.from_numpy(weights.scales), None, 1, bias)
        codes, scales, offsets = kernel_layout(weights)
        return cls.from_rows(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets),
                             len(weights.codes), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            return self.forward(x.float().contiguous()).to(x.dtype)
        self.check_buffers()
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"block_matmul: x has shape {tuple(x.shape)}, not (..., {self.in_features})")
        rows = x.numel() // self.in_features
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)  # [..., N]
        if rows == 0:
            return out
        # (looked up per call, not kept: a benchmark swaps the library to time another build's)
        check_status("block_matmul", library().block_matmul(
            address("block_matmul", "x", x), rows, self.in_features, self._codes, self._scales, self._offsets,
            self.scale_form, self.bits, self.out_features, self.groups, self.activations, out.data_ptr(),
            torch.get_num_threads()))
        if self.bias is not None:
            out += self.bias
        return out

    def check_buffers(self) -> None:
        """A ValueError unless the weight's buffers are what the kernels read (on the CPU,
        contiguous; a module moved to another device cannot run them)."""
        if self._problem is not None:
            raise ValueError(f"block_matmul: this BlockLinear's {self._problem}")

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
        if self.bits in (16, 32):  # float weights: their dtype says which (a cast may have changed it)
            self.bits = {torch.bfloat16: 16, torch.float32: 32}[self.codes.dtype]
        self.groups = self.codes.shape[1] // _GROUP_BYTES[self.bits] if self.bits in (4, 6, 8) \
            else self.in_features // GROUP
        self.scale_form = form_of(self.scales) if self.bits in (4, 8) else FLOAT32
        self._problem = next((f"{name} are on {t.device}, not the CPU" if t.device.type != "cpu" else
                              f"{name} are not contiguous" for name, t in
                              (("codes", self.codes), ("scales", self.scales), ("offsets", self.offsets))
                              if t.device.type != "cpu" or not t.is_contiguous()), None)
        if self.bits == 4 and self.scales.dtype != self.offsets.dtype:
            self._problem = f"scales ({self.scales.dtype}) and offsets ({self.offsets.dtype}) differ in form"
        self._codes, self._scales, self._offsets = (self.codes.data_ptr(), self.scales.data_ptr(),
                                                    self.offsets.data_ptr())

    @property
    def addresses(self) -> tuple[int, int, int | None]:
        """Where the codes, scales and offsets (None for 8 bits) are, for C callers."""
        return self._codes, self._scales, self._offsets if self.bits == 4 else None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of W dequantized [n, K] float32, exactly as the kernel's weights (a
        tied embedding looks its rows up here instead of keeping a second copy)."""
        if self.bits in (16, 32):
            return self.codes.view(self.codes.shape[0], self.in_features, BLOCK)[ids // BLOCK, :, ids % BLOCK].float()
        # code x scale (+ offset) per group, the terms added in order, in one C call (a step's
        # embedding: a dozen tensor operations cost several times the lookup)
        wanted = ids.to("cpu", torch.int64).contiguous().view(-1)
        out = torch.empty(len(wanted), self.in_features, dtype=torch.float32)
        if len(wanted) == 0:
            return out
        self.check_buffers()
        status = library().block_rows(self._codes, self._scales, self._offsets, self.scale_form, self.bits,
                                      self.out_features, self.groups, self.terms, wanted.data_ptr(), len(wanted),
                                      out.data_ptr())
        if status == ROW_OUTSIDE:
            raise IndexError(f"block_rows: row ids outside 0 .. {self.out_features - 1}")
        check_status("block_rows", status)
        return out

    def subset(self, ids: torch.Tensor) -> "BlockLinear":
        """A layer of output rows `ids` [n] of this one, their codes as they are (the same
        weights to the bit, meeting activations rounded the same way): a draft head's
        readout over its vocabulary."""
        layer = self._subset(ids)
        layer.activations = self.activations
        return layer

    def _subset(self, ids: torch.Tensor) -> "BlockLinear":
        if self.bits in (16, 32):
            return BlockLinear.from_float(self.rows(ids).to(self.codes.dtype), self._bias_rows(ids))
        if self.bits == 6:
            from specdraft.models.kernels.six_bit import subset_six

            codes, scales = subset_six(self.codes, self.scales, self.groups, ids)
            return BlockLinear(codes, scales, None, 1, self._bias_rows(ids), len(ids), bits=6)
        grouped, scales, offsets = self._row_layout(ids)
        return BlockLinear.from_rows(grouped.reshape(len(ids), -1), scales, offsets, self.terms, self._bias_rows(ids))

    def _row_layout(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows `ids` [n] of the quantized codes in the row layout (`to_blocks`' input): codes
        [n, G, bytes per group], scales and offsets [n, G] (offsets None for 8 bits)."""
        block, lane = ids // BLOCK, ids % BLOCK
        blocks, groups = self.codes.shape[0], self.groups

        def per_group(t: torch.Tensor) -> torch.Tensor:  # [n, G] of a [NB, G * 16] buffer, in float32
            return decoded(t).view(blocks, groups, BLOCK)[block, :, lane]

        chunks = 8 if self.bits == 8 else 4
        grouped = self.codes.view(blocks, groups, chunks, BLOCK, 4)[block, :, :, lane, :].reshape(len(ids), groups, -1)
        return grouped, per_group(self.scales), per_group(self.offsets) if self.bits == 4 else None

    def _bias_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach()[ids]

    @property
    def weight(self) -> torch.Tensor:
        """W dequantized [N, K] (a fresh tensor, for one-off readers such as a draft head's
        readout, never for a step)."""
        return self.rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        form = {4: f"terms={self.terms}", 6: "6-bit", 8: "int8", 16: "bfloat16", 32: "float32"}[self.bits]
        return f"in_features={self.in_features}, out_features={self.out_features}, {form}"


def to_int8_blocks(module: nn.Module) -> int:
    """Every float nn.Linear inside `module` (inputs a multiple of 32) replaced by a
    BlockLinear of int8 codes with a scale per group of 32 (Q8_0's layout): a draft head's
    products on the kernels its quantized target runs on, a quarter of float32's bytes.
    Returns how many moved."""
    moved = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % GROUP == 0:
                bias = None if child.bias is None else child.bias.detach().float()
                setattr(parent, name, BlockLinear.of(int8_groups(child.weight.detach().float().cpu().numpy()), bias))
                moved += 1
    return moved


def runs_on_file_quantization(model: nn.Module) -> bool:
    """Whether `model`'s matrices run on the block kernel (a GGUF model on its own quantization)."""
    return any(isinstance(module, BlockLinear) for module in model.modules())
