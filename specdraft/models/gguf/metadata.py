"""transformers' config and tokenizer of a GGUF file, read from gguf/file.py's parse of the
header instead of transformers' own readers.

transformers derives a config from a GGUF's metadata with `gguf.GGUFReader`, which builds a
numpy view for every string of the file (the token list and merges: ~30 s for a 150k-token
vocabulary on a 2-core CPU), and then parses every element of every array in Python, although
a config needs none of the vocabulary's strings. Its tokenizer reads the file once more with
`integrations.gguf.reader.read_gguf_metadata`. For these calls only, both readers are swapped
for ones served from the values already parsed: `_Reader` offers the fields in the shape
transformers reads them (`parts[i]` per element, `types`), at first without the vocabulary's
strings (a config or tokenizer that then lacks tokens is read again with them);
`_metadata_reader` answers as `read_gguf_metadata` does. transformers' own
mapping from metadata to config and tokenizer stays the single source of truth; should a
transformers version read something the shims do not offer, the call is retried with the
real readers.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from specdraft.models.gguf.file import GGUFFile

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


# The vocabulary's string arrays: a config reads only how many tokens there are.
_TOKENS = "tokenizer.ggml.tokens"
_VOCABULARY = (_TOKENS, "tokenizer.ggml.merges")
_UINT32 = 4
_ABSENT = object()  # a module attribute that was not there (a lazy module's name not yet looked up)


class _Reader:
    """What transformers reads of `gguf.GGUFReader` when it wants no tensor data. With
    `config_only` the vocabulary's strings are left out, since a config needs only their
    count: a file that does not state `<architecture>.vocab_size` gets it, as the count of its
    tokens (what transformers would count). A transformers that built its tokenizer from this
    reader would get fewer tokens than the file has, and is served again in full."""

    def __init__(self, parsed: GGUFFile, config_only: bool = False):
        metadata, types = dict(parsed.metadata), dict(parsed.value_types)
        tokens = metadata.get(_TOKENS)
        if config_only and tokens is not None and parsed.architecture is not None:
            size_key = f"{parsed.architecture}.vocab_size"
            if size_key not in metadata:
                metadata[size_key], types[size_key] = len(tokens), (_UINT32, None)
            for key in _VOCABULARY:
                if key in metadata:
                    metadata[key] = []
        self.fields = {key: _Field(key, value, *types[key]) for key, value in metadata.items()}
        self.tensors = [_Tensor(name) for name in parsed.tensors]


def _metadata_reader(parsed: GGUFFile) -> Any:
    """`read_gguf_metadata(path, string_arrays)` of transformers' own reader, answered from
    `parsed`: numeric arrays as lists, string arrays as lists when asked for, else their length."""
    def read(path: Any, string_arrays: Any = ()) -> tuple[dict, tuple[str, ...]]:
        metadata = {}
        for key, value in parsed.metadata.items():
            kind, element = parsed.value_types[key]
            if kind == _ARRAY and element == _STRING:
                metadata[key] = list(value) if key in string_arrays else len(value)
            elif kind == _ARRAY:
                metadata[key] = np.asarray(value).tolist()
            else:
                metadata[key] = value
        return metadata, tuple(parsed.tensors)
    return read


@contextlib.contextmanager
def _fast_readers(parsed: GGUFFile, config_only: bool) -> Iterator[None]:
    import gguf

    ours = parsed.path.resolve()

    def serve(original: Any, reader: Callable[..., Any]) -> Callable[..., Any]:
        return lambda path, *args, **kwargs: (reader(path, *args, **kwargs) if Path(path).resolve() == ours
                                              else original(path, *args, **kwargs))

    swaps = [(gguf, "GGUFReader", lambda path, *args, **kwargs: _Reader(parsed, config_only))]
    try:
        from transformers.integrations import gguf as transformers_gguf
        from transformers.integrations.gguf import reader as transformers_reader
    except ImportError:  # a transformers without its own reader reads through gguf's
        transformers_gguf = transformers_reader = None
    if transformers_reader is not None and hasattr(transformers_reader, "read_gguf_metadata"):
        # Both the module and its lazy package, which keeps a name once it has been looked up
        # there (transformers imports it from either).
        for module in (transformers_reader, transformers_gguf):
            swaps.append((module, "read_gguf_metadata", _metadata_reader(parsed)))
    saved = [(module, name, vars(module).get(name, _ABSENT)) for module, name, _ in swaps]
    try:
        for module, name, reader in swaps:
            setattr(module, name, serve(getattr(module, name), reader))
        yield
    finally:
        for module, name, original in reversed(saved):
            if original is _ABSENT:
                delattr(module, name)  # looked up lazily again, as before
            else:
                setattr(module, name, original)



def read_config_and_tokenizer(gguf: Path, parsed: GGUFFile | None = None) -> tuple[Any, Any]:
    """(config, tokenizer) transformers derives from the metadata of `gguf`."""
    from transformers import AutoConfig, AutoTokenizer

    parsed = parsed or GGUFFile(gguf)

    def config() -> Any:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)

    def tokenizer(config: Any) -> Any:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                             local_files_only=True)

    tokens = parsed.metadata.get(_TOKENS)
    for config_only in (True, False):
        try:
            with _fast_readers(parsed, config_only):
                read_config = config()
                read_tokenizer = tokenizer(read_config)
        except (AttributeError, TypeError, IndexError, KeyError, ValueError) as exc:  # a transformers the shims do not fit
            log.debug("reading %s's metadata through the shims failed (%s)", gguf.name, exc)
            continue
        if tokens is None or (len(read_tokenizer) >= len(tokens)
                              and (parsed.field("vocab_size") is not None or read_config.vocab_size == len(tokens))):
            return read_config, read_tokenizer
        # this transformers read the vocabulary from what GGUFReader served: serve it all
    log.debug("reading %s's metadata with transformers' own readers", gguf.name)
    read_config = config()
    return read_config, tokenizer(read_config)
