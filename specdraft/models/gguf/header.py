"""What a GGUF file's header says, read without parsing the rest of it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


def gguf_architecture(gguf: Path) -> str | None:
    """The file's `general.architecture`, or None when its header cannot be read. Reads the
    header's key-value pairs only up to that key (llama.cpp writes it first): the `gguf`
    package's reader parses the whole tokenizer vocabulary, seconds on every load."""
    try:
        with open(gguf, "rb") as fh:
            magic, version, _, pairs = struct.unpack("<4sIQQ", fh.read(24))
            if magic != b"GGUF" or version < 2:
                return None
            for _ in range(pairs):
                key = fh.read(struct.unpack("<Q", fh.read(8))[0]).decode("utf-8")
                (kind,) = struct.unpack("<I", fh.read(4))
                if key == "general.architecture" and kind == _STRING:
                    return fh.read(struct.unpack("<Q", fh.read(8))[0]).decode("utf-8")
                _skip(fh, kind)
    except (OSError, KeyError, UnicodeDecodeError, struct.error):
        return None
    return None


def _skip(fh: BinaryIO, kind: int) -> None:
    """Move past one value of GGUF type `kind`."""
    if kind == _STRING:
        fh.seek(struct.unpack("<Q", fh.read(8))[0], 1)
    elif kind == _ARRAY:
        element, count = struct.unpack("<IQ", fh.read(12))
        if element in _SCALAR_SIZES:
            fh.seek(_SCALAR_SIZES[element] * count, 1)
        else:
            for _ in range(count):
                _skip(fh, element)
    else:
        fh.seek(_SCALAR_SIZES[kind], 1)
