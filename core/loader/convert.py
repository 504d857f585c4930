"""A PyTorch `.bin` checkpoint rewritten as safetensors, as TGI's `download-weights` does
(text_generation_server/utils/convert.py): each `pytorch_model*.bin` becomes
`model*.safetensors` beside it, tensors that share memory (tied embeddings) are written
once (the model's tied names are the ones dropped), every file is read back and compared
with what was loaded, and a sharded checkpoint's `pytorch_model.bin.index.json` gets its
`model.safetensors.index.json`. Used by `switchyard download-weights`
(gateway/download.py); never at serve time."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable

import torch
from safetensors.torch import load_file, save_file

BIN_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_name(bin_name: str) -> str:
    """`pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors` (TGI's names)."""
    stem = bin_name[:-len(".bin")] if bin_name.endswith(".bin") else bin_name
    return stem.replace("pytorch_model", "model", 1) + ".safetensors"


def _shared_groups(state_dict: dict[str, torch.Tensor]) -> list[set[str]]:
    """Names whose tensors live in one storage (only groups of two or more)."""
    groups: dict[tuple, set[str]] = defaultdict(set)
    for name, tensor in state_dict.items():
        if tensor.device.type != "meta" and tensor.untyped_storage().nbytes():
            groups[(tensor.device, tensor.untyped_storage().data_ptr())].add(name)
    return [names for names in groups.values() if len(names) > 1]


def _is_complete(tensor: torch.Tensor) -> bool:
    """Whether the tensor covers its whole storage (a view of part of it cannot stand for the rest)."""
    return tensor.data_ptr() == tensor.untyped_storage().data_ptr() and \
        tensor.nelement() * tensor.element_size() == tensor.untyped_storage().nbytes()


def duplicate_names(state_dict: dict[str, torch.Tensor], discard_names: Iterable[str] = ()) -> dict[str, str]:
    """{name dropped: name kept} for tensors that share memory: one complete name is kept
    per group, preferring one the model does not list as tied (`discard_names`)."""
    discard = set(discard_names)
    dropped = {}
    for names in _shared_groups(state_dict):
        complete = sorted(name for name in names if _is_complete(state_dict[name]))
        if not complete:
            raise ValueError(f"tensors {sorted(names)} share memory but none covers it whole; "
                             "they cannot be written to safetensors")
        kept = next((name for name in complete if name not in discard), complete[0])
        dropped.update({name: kept for name in sorted(names) if name != kept})
    return dropped


def convert_file(bin_path: str, safetensors_path: str, discard_names: Iterable[str] = ()) -> dict[str, str]:
    """One `.bin` file written as safetensors; returns {name dropped: name kept}. The file
    is read with `weights_only` (no pickled code runs) and checked tensor for tensor."""
    loaded = torch.load(bin_path, map_location="cpu", weights_only=True)
    if "state_dict" in loaded:
        loaded = loaded["state_dict"]
    dropped = duplicate_names(loaded, discard_names)
    tensors = {name: tensor.contiguous() for name, tensor in loaded.items() if name not in dropped}
    metadata = {"format": "pt", **dropped}  # TGI's metadata: each dropped name points at its kept one
    partial = safetensors_path + ".partial"
    save_file(tensors, partial, metadata=metadata)
    reloaded = load_file(partial)
    for name, tensor in tensors.items():
        if not torch.equal(tensor, reloaded[name]):
            os.remove(partial)
            raise ValueError(f"{os.path.basename(bin_path)}: tensor {name!r} differs after conversion")
    os.replace(partial, safetensors_path)
    return dropped


def tied_names(directory: str) -> tuple[str, ...]:
    """The names the model's transformers class ties to another (`_tied_weights_keys`, a
    list or, in transformers 5, a {tied: source} dict): the ones a shared group drops.
    None are known for an architecture transformers does not have."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError):
        return ()
    keys = ()
    for architecture in getattr(config, "architectures", None) or ():
        keys = getattr(getattr(transformers, architecture, None), "_tied_weights_keys", None) or keys
    return tuple(keys)


def convert_directory(directory: str, discard_names: Iterable[str] | None = None) -> list[str]:
    """Every `pytorch_model*.bin` under `directory` that has no safetensors yet, converted
    beside it (and the sharded index); returns the safetensors files written. The names
    dropped from shared groups default to the model's tied ones (`tied_names`)."""
    discard = tuple(tied_names(directory) if discard_names is None else discard_names)
    written, weight_map = [], {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("pytorch_model") and name.endswith(".bin")):
            continue
        target = os.path.join(directory, safetensors_name(name))
        if not os.path.exists(target):
            convert_file(os.path.join(directory, name), target, discard)
            written.append(target)
        weight_map[name] = safetensors_name(name)
    bin_index = os.path.join(directory, BIN_INDEX)
    st_index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.exists(bin_index) and not os.path.exists(st_index):
        with open(bin_index) as f:
            index = json.load(f)
        kept = {}
        for file_name in set(weight_map.values()):
            with open(os.path.join(directory, file_name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            kept.update({tensor: file_name for tensor in header if tensor != "__metadata__"})
        index["weight_map"] = dict(sorted(kept.items()))
        with open(st_index + ".partial", "w") as f:
            json.dump(index, f, indent=2)
        os.replace(st_index + ".partial", st_index)
    return written


__all__ = ["convert_directory", "convert_file", "duplicate_names", "safetensors_name", "tied_names"]
