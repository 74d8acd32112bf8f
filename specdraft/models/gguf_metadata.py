"""transformers' config and tokenizer of a GGUF file, read from gguf_file.py's parse of the
header instead of the `gguf` package's reader.

transformers derives a config from a GGUF's metadata with `gguf.GGUFReader`, which builds a
numpy view for every string of the file (the token list and merges: ~30 s for a 150k-token
vocabulary on a 2-core CPU, twice, since the tokenizer asks for the config too). The reader is
swapped, for that call only, for `_Reader`: the same fields in the shape transformers reads
them (`parts[i]` per element, `types`), served from the values already parsed. transformers'
own mapping from metadata to config stays the single source of truth; should a transformers
version read something the shim does not offer, the call is retried with the real reader.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from specdraft.models.gguf_file import GGUFFile

log = logging.getLogger("specdraft")
_STRING, _ARRAY = 8, 9


class _Elements:
    """`parts` of an array field: element i as transformers parses it (a one-element array,
    or a string's UTF-8 bytes)."""

    def __init__(self, values: Any, element: int):
        self.values, self.element = values, element

    def __getitem__(self, index: int) -> np.ndarray:
        if self.element == _STRING:
            return np.frombuffer(self.values[index].encode("utf-8"), dtype=np.uint8)
        return np.asarray(self.values[index : index + 1])


class _Field:
    def __init__(self, name: str, value: Any, kind: int, element: int | None):
        self.name = name
        if kind == _ARRAY:
            self.types, self.data, self.parts = [_ARRAY, element], range(len(value)), _Elements(value, element)
        elif kind == _STRING:
            self.types, self.data, self.parts = [_STRING], [0], [np.frombuffer(value.encode("utf-8"), dtype=np.uint8)]
        else:
            self.types, self.data, self.parts = [kind], [0], [np.asarray([value])]

    def contents(self) -> Any:
        parts = [self.parts[i] for i in self.data]
        if self.types[0] == _ARRAY:
            return [p.tobytes().decode("utf-8") if self.types[1] == _STRING else p[0].item() for p in parts]
        return parts[0].tobytes().decode("utf-8") if self.types[0] == _STRING else parts[0][0].item()


class _Tensor:
    def __init__(self, name: str):
        self.name = name


class _Reader:
    """What transformers reads of `gguf.GGUFReader` when it wants no tensor data."""

    def __init__(self, parsed: GGUFFile):
        self.fields = {key: _Field(key, value, *parsed.value_types[key]) for key, value in parsed.metadata.items()}
        self.tensors = [_Tensor(name) for name in parsed.tensors]


@contextlib.contextmanager
def _fast_reader(parsed: GGUFFile) -> Iterator[None]:
    import gguf

    original = gguf.GGUFReader
    gguf.GGUFReader = lambda path, *args, **kwargs: _Reader(parsed) \
        if Path(path).resolve() == parsed.path.resolve() else original(path, *args, **kwargs)
    try:
        yield
    finally:
        gguf.GGUFReader = original


def read_config_and_tokenizer(gguf: Path, parsed: GGUFFile | None = None) -> tuple[Any, Any]:
    """(config, tokenizer) transformers derives from the metadata of `gguf`."""
    from transformers import AutoConfig, AutoTokenizer

    parsed = parsed or GGUFFile(gguf)

    def read() -> tuple[Any, Any]:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        return config, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                     local_files_only=True)

    try:
        with _fast_reader(parsed):
            return read()
    except (AttributeError, TypeError, IndexError, KeyError) as exc:  # a transformers the shim does not fit
        log.debug("reading %s's metadata with gguf's own reader (%s)", gguf.name, exc)
        return read()
