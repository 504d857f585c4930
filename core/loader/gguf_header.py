"""A GGUF file's header read as it lies (the key-value metadata and the tensor names), without
gguf-py's GGUFReader, which builds every array item of a tokenizer's vocabulary and merges as its
own field part (seconds for a 50k vocabulary). Large arrays are skipped, known only by their
length. For decisions made before a file is parsed (gguf_weights.py: which reader reads its
config) and configs that need the metadata only."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

# GGUF value types (gguf-py's GGUFValueType) -> struct format of a scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class SkippedArray:
    """An array longer than read_header's `largest_array`: its length only."""

    length: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # key -> value (a list for an array, SkippedArray for a long one)
    tensor_names: tuple[str, ...]


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, largest_array: int) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ValueError(f"GGUF value type {kind} is not known")
    item, length = _unpack(f, "<I"), _unpack(f, "<Q")
    if length <= largest_array:
        return [_value(f, item, largest_array) for _ in range(length)]
    if item in _SCALARS:
        f.seek(length * struct.calcsize(_SCALARS[item]), 1)
    for _ in range(length if item not in _SCALARS else 0):
        if item == _STRING:
            f.seek(_unpack(f, "<Q"), 1)
        else:
            _value(f, item, 0)
    return SkippedArray(length)


def read_header(path: str, largest_array: int = 64) -> GGUFHeader:
    """The metadata (arrays of up to `largest_array` items read) and the tensor names of a GGUF
    file (version 2 or 3); ValueError where it is not one."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or _unpack(f, "<I") not in (2, 3):
            raise ValueError(f"{path!r} is not a GGUF file of version 2 or 3")
        tensors, keys = _unpack(f, "<Q"), _unpack(f, "<Q")
        metadata = {}
        for _ in range(keys):
            key = _string(f)
            metadata[key] = _value(f, _unpack(f, "<I"), largest_array)
        names = []
        for _ in range(tensors):
            names.append(_string(f))
            dims = _unpack(f, "<I")
            f.seek(8 * dims + 4 + 8, 1)  # the dimensions, the type, the offset
    return GGUFHeader(metadata, tuple(names))
