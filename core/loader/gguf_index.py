"""A GGUF file's tensor table and Hugging Face names, worked out once and kept beside its
converted metadata (gguf_cache.py), so that a cached start maps the file without parsing it.

Parsing a GGUF with gguf-py's reader walks every metadata field (5 s for the default model's
49k-token vocabulary on a busy 2-core machine), and transformers' name mapping builds the
model class on the meta device and a name table per module (9 s): together most of a cached
start. The index holds what loading needs, per tensor: the GGUF name, the ggml type, the shape
(ggml's order) and where its bytes lie, as the reader would view them; plus the architecture,
the kind of processing its tensors get (gguf_processors.py) and the GGUF -> Hugging Face names.
It is stamped with the file's size and mtime and the versions of gguf and transformers (the
names are transformers' mapping); anything else is ignored and made again. An index that
cannot be written (a read-only cache) is only skipped.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

INDEX_FILE = "tensor_index.json"
FORMAT_VERSION = 2  # 2: the processor kind


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor as the loaders use gguf-py's ReaderTensor: name, ggml type, shape, data (a view
    of the mapped file)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the contiguous dimension first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str | None
    processor: str  # how its tensors are processed after dequantizing (gguf_processors.py)
    names: dict[str, str]  # GGUF tensor name -> Hugging Face name
    tensors: list  # IndexedTensor, or the reader's own ReaderTensor when just parsed


def _stamp(path: str) -> dict:
    stat = os.stat(path)
    return {"format": FORMAT_VERSION, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "gguf": version("gguf"), "transformers": version("transformers")}


def read_index(directory: str, path: str) -> GGUFIndex | None:
    """The index of `path` kept in `directory`, its tensors viewing the mapped file; None when
    there is none or it is stale."""
    from gguf import GGMLQuantizationType

    try:
        with open(os.path.join(directory, INDEX_FILE)) as file:
            index = json.load(file)
        if index.get("stamp") != _stamp(path):
            return None
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = [IndexedTensor(t["name"], GGMLQuantizationType(t["type"]), tuple(t["shape"]),
                                 mapped[t["offset"]:t["offset"] + t["nbytes"]].view(np.dtype(t["dtype"]))
                                 .reshape(t["data_shape"]))
                   for t in index["tensors"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return GGUFIndex(index["architecture"], index["processor"], index["names"], tensors)


def write_index(directory: str, path: str, index: GGUFIndex) -> None:
    """Keeps `index` (its tensors gguf-py's ReaderTensors) in `directory`, atomically."""
    entry = {"stamp": _stamp(path), "architecture": index.architecture, "processor": index.processor,
             "names": index.names,
             "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                          "offset": int(t.data_offset), "nbytes": int(t.data.nbytes), "dtype": t.data.dtype.str,
                          "data_shape": list(t.data.shape)} for t in index.tensors]}
    staging = os.path.join(directory, f".{INDEX_FILE}.{os.getpid()}")
    try:
        with open(staging, "w") as file:
            json.dump(entry, file)
        os.replace(staging, os.path.join(directory, INDEX_FILE))
    except OSError as error:
        logger.info("the tensor index of %s is not kept (%s): the next start reads the file again", path, error)
        if os.path.exists(staging):
            os.remove(staging)
