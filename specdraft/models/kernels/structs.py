"""The C kernels' shared constants and the structs Python fills for them, as ctypes sees them
(cpu_kernels_shared.h): a weight's table entry (`Matrix`), a decoder layer's (`Layer`,
native_layers.py fills a table of them) and a mixture of experts' (`Experts`). When a build
loads, native.py compares `layout()` with the build's own `kernel_layout` (the same numbers,
read by C's sizeof and offsetof), so a header and a mirror that drift apart are a
KernelBuildError, never a misread table."""

from __future__ import annotations

import ctypes

from specdraft.models.kernels.formats import GROUP

BLOCK = 16  # output columns of one weight block
SIX_GROUP_BYTES, SIX_SCALE_BYTES = 384, 36  # a 6-bit group's codes and scales in one block
MAX_PARTS = 3  # matrices side by side in one projection (q, k, v)
MAX_HEAD_DIM = 256  # the largest head size attention takes (its accumulators: D / 8 registers)
HEAD_LANES = 8  # a head size is a multiple of this
# How the activations a weight meets are quantized (cpu_kernels_shared.h ACTIVATIONS_*): the
# kernels' own groups of 32, or as llama.cpp rounds them for a GGUF file's format
ACTIVATIONS_OWN, ACTIVATIONS_Q8_0, ACTIVATIONS_Q8_1, ACTIVATIONS_Q8_K = 0, 1, 2, 3


class Matrix(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_int), ("groups", ctypes.c_int), ("bits", ctypes.c_int),
                ("form", ctypes.c_int), ("activations", ctypes.c_int)]


class Experts(ctypes.Structure):
    _fields_ = [("router", Matrix), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("count", ctypes.c_int),
                ("used", ctypes.c_int), ("parts", ctypes.c_int), ("normalize", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("qkv", Matrix * MAX_PARTS), ("gate_up", Matrix * MAX_PARTS),
                ("out", Matrix), ("down", Matrix), ("qkv_parts", ctypes.c_int), ("gate_up_parts", ctypes.c_int),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
                ("post_norm1", ctypes.c_void_p), ("post_norm2", ctypes.c_void_p), ("activation", ctypes.c_int),
                ("window", ctypes.c_int), ("rope", ctypes.c_int), ("experts", ctypes.c_void_p)]


# The fields of each struct in the C declaration's order (cpu_kernels_shared.h)
FIELDS = {"Matrix": ("codes", "scale", "offset", "bias", "N", "groups", "bits", "form", "activations"),
          "Layer": ("norm1", "norm2", "eps1", "eps2", "qkv", "gate_up", "out", "down", "qkv_parts", "gate_up_parts",
                    "q_norm", "k_norm", "qk_eps", "post_norm1", "post_norm2", "activation", "window", "rope",
                    "experts"),
          "Experts": ("router", "gate_up", "down", "count", "used", "parts", "normalize")}


def layout() -> list[int]:
    """What `kernel_layout` (cpu_boundary.c) gives for these: the constants, then each struct's
    size and, field by field in C's order, the mirror's offset and size (-1, -1: no such
    field). Read when called, so a replaced mirror is seen."""
    values = [GROUP, BLOCK, SIX_GROUP_BYTES, SIX_SCALE_BYTES, MAX_PARTS, MAX_HEAD_DIM]
    for struct in (Matrix, Layer, Experts):
        values.append(ctypes.sizeof(struct))
        for name in FIELDS[struct.__name__]:
            field = getattr(struct, name, None)
            values += [field.offset, field.size] if isinstance(field, type(Matrix.codes)) else [-1, -1]
    return values
