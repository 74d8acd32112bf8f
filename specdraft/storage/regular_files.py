"""Reading a file specdraft did not necessarily write (a profile, a trace, a cache record):
only a regular file, and only up to a size, so that a FIFO cannot block a run for ever and
`/dev/zero` or a huge file cannot exhaust memory.

The file is opened without blocking (a FIFO with no writer would otherwise wait in open),
its kind and size are taken from the open descriptor (no race with a rename), and a file
over the limit is refused before its content is read. Errors are OSError or ValueError with
a one-line cause; callers add the path and the flag.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_LIMIT = 256 << 20  # no profile, trace, record or state of ours comes near this


def read_regular_bytes(path: str | Path, limit: int = DEFAULT_LIMIT) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a pipe, device, socket or folder)")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than the {limit} a file of this kind may have")
        chunks, left = [], limit + 1
        while left > 0:  # a file growing while read is still held to the limit
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise ValueError(f"more than the {limit} bytes a file of this kind may have")
        return data
    finally:
        os.close(fd)


def read_regular_text(path: str | Path, limit: int = DEFAULT_LIMIT) -> str:
    """The UTF-8 text of `path` (see read_regular_bytes); ValueError when it is not UTF-8."""
    data = read_regular_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None


def is_regular(path: str | Path) -> bool:
    """Whether `path` is a regular file (links followed), without opening it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def read_npy(path: str | Path, limit: int = DEFAULT_LIMIT):
    """A one-dimensional-or-more `.npy` array from a regular file, its header's shape and
    dtype checked against the bytes present before anything is allocated (numpy's own
    reader allocates what a header claims first). No object arrays. ValueError on damage."""
    import io

    import numpy as np

    data = read_regular_bytes(path, limit)
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f"array format version {version}")
        shape, fortran, dtype = readers[version](stream)
    except (ValueError, SyntaxError, TypeError) as exc:
        raise ValueError(f"not an array file ({exc})") from None
    if dtype.hasobject:
        raise ValueError("an array of Python objects")
    count = 1
    for size in shape:
        count *= int(size)
    body = len(data) - stream.tell()
    if count * dtype.itemsize != body:
        raise ValueError(f"its header claims {count} elements of {dtype.itemsize} bytes, the file holds {body} bytes")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return array.reshape(shape, order="F" if fortran else "C")
