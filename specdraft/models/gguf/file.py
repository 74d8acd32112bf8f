"""A GGUF file read as llama.cpp reads it: the header's key-value pairs and tensor table
parsed once, the tensor data memory-mapped, never copied.

Every count and size the header claims is checked against the file's length before anything
is allocated for it (a damaged or hostile file is a `GGUFError` naming the file, never a
multi-gigabyte allocation or a loop over a billion entries). The mapping is private
(copy-on-write): tensors are numpy views of the page cache, and a torch tensor made from one
may be written without touching the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGML type number -> (name, weights per block, bytes per block): ggml.h's table
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
         11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
         15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
         19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
         23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
         28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
         35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17)}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_NAME = 1 << 16


class GGUFError(ValueError):
    """A file that is not a readable GGUF model (the message names the file and the cause)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # as GGUF lists it: the innermost (contiguous) dimension first
    offset: int  # from the start of the file
    nbytes: int

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, columns) of a matrix: columns are the contiguous dimension."""
        return (self.shape[1] if len(self.shape) > 1 else 1), self.shape[0]


class GGUFFile:
    """The parsed header of `path` and its mapped tensors (`data(name)`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self.size = fh.seek(0, 2)
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        except OSError as exc:
            raise GGUFError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        parser = _Parser(self._map if self._map is not None else b"", self.size, self.path.name)
        self.metadata, self.tensors = parser.parse()
        self.value_types = parser.value_types  # key -> (GGUF value type, element type of an array)

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def field(self, name: str, default: Any = None) -> Any:
        """`<architecture>.<name>` (or `name` itself when it has a dot-free prefix elsewhere)."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def data(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name` (uint8, a view of the mapping)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def floats(self, name: str) -> np.ndarray:
        """Tensor `name` of a float type as float32, shaped outermost dimension first (a copy)."""
        info = self.tensors[name]
        raw = self.data(name)
        if info.type_name == "BF16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info.type_name in FLOAT_TYPES:
            values = raw.view(FLOAT_TYPES[info.type_name]).astype(np.float32)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            values = np.asarray(dequantize(raw, GGMLQuantizationType[info.type_name]), dtype=np.float32)
        return values.reshape(tuple(reversed(info.shape)))

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # tensors still view it: the mapping goes with them
                pass


_U64 = struct.Struct("<Q")


class _Parser:
    """One pass over a GGUF header held in `buffer` (the mapping: nothing is copied but the
    values), every claimed length checked against what is left. A vocabulary's strings are
    read in one tight loop: a large one has hundreds of thousands."""

    def __init__(self, buffer: Any, size: int, name: str):
        self.buffer, self.size, self.name, self.pos = buffer, size, name, 0
        self.value_types: dict[str, tuple[int, int | None]] = {}
        self._element: int | None = None

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{self.name} is not a readable GGUF file: {why}")

    def take(self, count: int) -> int:
        """The offset of the next `count` bytes, which the header must still hold; moves past them."""
        if count < 0 or self.pos + count > self.size:
            raise self.fail(f"it ends inside its header (needs {count} bytes at offset {self.pos})")
        self.pos += count
        return self.pos - count

    def read(self, count: int) -> bytes:
        start = self.take(count)
        return self.buffer[start:start + count]

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        buffer, size, pos, unpack = self.buffer, self.size, self.pos, _U64.unpack_from
        pieces = []
        for _ in range(count):
            if pos + 8 > size:
                raise self.fail(f"it ends inside its header (needs 8 bytes at offset {pos})")
            (length,) = unpack(buffer, pos)
            pos += 8
            if length > size - pos:
                raise self.fail(f"it ends inside its header (needs {length} bytes at offset {pos})")
            pieces.append(buffer[pos:pos + length])
            pos += length
        self.pos = pos
        try:
            return [piece.decode("utf-8") for piece in pieces]
        except UnicodeDecodeError:
            raise self.fail("a string in its header is not UTF-8") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            self._element = element
            left = self.size - self.pos
            if element in _ARRAY_DTYPES:
                width = np.dtype(_ARRAY_DTYPES[element]).itemsize
                if count * width > left:
                    raise self.fail(f"an array claims {count} elements, more than the file holds")
                return np.frombuffer(self.read(count * width), dtype=_ARRAY_DTYPES[element])
            if element == _STRING:
                if count * 8 > left:
                    raise self.fail(f"an array claims {count} strings, more than the file holds")
                return self.strings(count)
            raise self.fail(f"an array of value type {element} is not supported")
        raise self.fail(f"unknown value type {kind}")

    def parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        if self.size == 0:
            raise self.fail("it is empty")
        magic = self.read(4)
        if magic != b"GGUF":
            raise self.fail("it does not start with GGUF")
        version = self.unpack("<I")
        if version not in (2, 3):
            raise self.fail(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_pairs = self.unpack("<Q"), self.unpack("<Q")
        if n_pairs * 13 > self.size or n_tensors * 24 > self.size:
            raise self.fail(f"its header claims {n_pairs} keys and {n_tensors} tensors, more than the file holds")
        metadata = {}
        for _ in range(n_pairs):
            key = self.string()
            kind, self._element = self.unpack("<I"), None
            metadata[key] = self.value(kind)
            self.value_types[key] = (kind, self._element)
        raw = []
        for _ in range(n_tensors):
            name = self.string()
            dims = self.unpack("<I")
            if not 1 <= dims <= _MAX_DIMS or len(name) > _MAX_NAME:
                raise self.fail(f"tensor {name[:80]!r} has {dims} dimensions")
            shape = tuple(self.unpack("<Q") for _ in range(dims))
            raw.append((name, shape, self.unpack("<I"), self.unpack("<Q")))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self.pos // alignment) * alignment
        return metadata, self._tensors(raw, start)

    def _tensors(self, raw: list, start: int) -> dict[str, TensorInfo]:
        tensors = {}
        for name, shape, type_number, offset in raw:
            if type_number not in TYPES:
                raise self.fail(f"tensor {name} has unknown type {type_number}")
            type_name, per_block, block_bytes = TYPES[type_number]
            count = 1
            for dim in shape:
                count *= dim
            if count == 0 or shape[0] % per_block:
                raise self.fail(f"tensor {name} of shape {list(shape)} does not fill whole {type_name} blocks")
            nbytes = count // per_block * block_bytes
            begin = start + offset
            if begin + nbytes > self.size:
                raise self.fail(f"tensor {name} ({nbytes} bytes at {begin}) lies past the file's end "
                                f"({self.size} bytes): the file is truncated or damaged")
            if name in tensors:
                raise self.fail(f"tensor {name} appears twice")
            tensors[name] = TensorInfo(name, type_name, shape, begin, nbytes)
        return tensors
