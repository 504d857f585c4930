"""llama.cpp's `{architecture}.pooling_type` of a GGUF file, read from its header alone.

gguf-py's reader parses every field and the tensor table (seconds for a 49k-token vocabulary);
this walks the key-value section once, skipping values it does not want (the vocabulary's
arrays by their lengths), and stops at the tensor table. Values as llama.cpp's
`enum llama_pooling_type`: 0 none, 1 mean, 2 cls, 3 last, 4 rank."""
from __future__ import annotations

import struct

GGUF_MAGIC = b"GGUF"
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64; the size of each fixed-size one
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
_STRING, _ARRAY = 8, 9


class _Header:
    def __init__(self, data: memoryview):
        self.data, self.offset = data, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        text = bytes(self.data[self.offset:self.offset + length]).decode("utf-8", "replace")
        self.offset += length
        return text

    def skip(self, value_type: int) -> None:
        if value_type in _FIXED_SIZES:
            self.offset += _FIXED_SIZES[value_type]
        elif value_type == _STRING:
            length = self.unpack("<Q")
            self.offset += length
        elif value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _FIXED_SIZES:
                self.offset += _FIXED_SIZES[item_type] * count
            else:
                for _ in range(count):
                    self.skip(item_type)
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


def gguf_pooling_type(path: str) -> str | None:
    """The file's pooling type ("none", "mean", "cls", "last", "rank"), or None when the file
    does not say (a model made for generation)."""
    import mmap

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        header = _Header(memoryview(mapped))
        try:
            return _pooling_type(header)
        finally:
            header.data.release()


def _pooling_type(header: _Header) -> str | None:
    if bytes(header.data[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    header.offset = 4
    version = header.unpack("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    header.unpack("<Q")  # tensor count
    num_fields = header.unpack("<Q")
    for _ in range(num_fields):
        key, value_type = header.string(), header.unpack("<I")
        if key.endswith(".pooling_type") and value_type in _INTEGER_FORMATS:
            value = header.unpack(_INTEGER_FORMATS[value_type])
            return POOLING_TYPES.get(value, f"unknown ({value})")
        header.skip(value_type)
    return None
