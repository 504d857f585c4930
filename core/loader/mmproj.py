"""llama.cpp's mmproj file: a vision-language model's vision tower and connector, kept apart from
its language model's GGUF (`--mmproj FILE` beside `--model-id TEXT.gguf`, as llama-server takes
`-m TEXT.gguf --mmproj MMPROJ.gguf`).

The language model loads as any GGUF does (its blocks packed, gguf_packed.py); this module reads
the other file, with the `gguf` package, and decides once, at start, everything the pair adds:
- the vision config, from the file's `clip.vision.*` metadata (what llama.cpp's converter,
  convert_hf_to_gguf.py, wrote from the checkpoint's config);
- the composite model's config around the text GGUF's (`vision_language_config`): the native
  class of its projector type, the image token's id in the text GGUF's tokenizer;
- how images are prepared (`processor_config`, laid out for the family's
  `ImageFamily.processor_from_config`, core/multimodal/), since no processor files come with a
  GGUF pair;
- every tensor's place in our modules (core/models/siglip.py, gemma3_vision.py, qwen2_vision.py,
  qwen2_5_vision.py), by gguf-py's own name table (the converter's), and its shape, checked
  against the config and the text model; a tensor the converter split (Qwen2-VL's qkv, its
  Conv3d patch embedding) is its parts, put back together as it is read.
What differs between projector types is said by one class each (mmproj_projectors.py, PROJECTORS,
picked here by `clip.projector_type`).
Anything it cannot serve is refused in one line (MmprojError), before a weight is read. The weights
themselves (`MmprojWeights`) are dequantized from whatever type the file holds (F32, F16, BF16,
Q8_0, ...) to float32, any value the converter changed changed back; the model copies them into
its dtype.

Served projector types: PROJECTORS (llama.cpp's `clip.projector_type`): idefics3, gemma3,
qwen2vl_merger, qwen2.5vl_merger.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..models.plain_config import PlainConfig
from .mmproj_projectors import PROJECTORS, MmprojError, Projector

__all__ = ["Mmproj", "MmprojError", "MmprojWeights", "PROJECTORS", "read_mmproj", "vision_language_config"]


@dataclass(frozen=True)
class Mmproj:
    """What an mmproj file says, checked: its projector, the vision config (transformers' names,
    as a checkpoint's vision_config), the connector's scale factor, the width it projects to, how
    images are prepared."""

    path: str
    projector_type: str
    vision: dict[str, Any]
    scale_factor: int
    projection_dim: int
    processor_config: dict[str, Any]

    @property
    def projector(self) -> Projector:
        return PROJECTORS[self.projector_type]


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise MmprojError(f"--mmproj {path!r}: no such file")
    try:
        return GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - gguf-py raises ValueError/struct errors on a non-GGUF file
        raise MmprojError(f"--mmproj {os.path.basename(path)!r} is not a GGUF file ({error}); give llama.cpp's "
                          "mmproj GGUF of the model (convert_hf_to_gguf.py --mmproj)") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _activation(reader: Any) -> str:
    """The vision MLP's activation, as clip.cpp reads it: gelu (ggml's, tanh-approximated), silu,
    else quick gelu."""
    if _field(reader, "clip.use_silu", False):
        return "silu"
    return "gelu_pytorch_tanh" if _field(reader, "clip.use_gelu", False) else "quick_gelu"


_FLAGS = {"silu": "a SiLU vision MLP (clip.use_silu)", "gelu_pytorch_tanh": "a GELU vision MLP (clip.use_gelu)",
          "quick_gelu": "a quick-GELU vision MLP (neither clip.use_gelu nor clip.use_silu)"}


def _projector_type(reader: Any) -> Any:
    return _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")


def read_mmproj(path: str) -> Mmproj:
    """The file's metadata and tensor table, checked (no weight is read); MmprojError names what is
    wrong: not a GGUF, not a vision mmproj, a projector type not served, tensors that do not fit."""
    reader = _reader(path)
    name = os.path.basename(path)
    architecture = _field(reader, "general.architecture")
    if architecture != "clip" or not _field(reader, "clip.has_vision_encoder", False):
        what = f"architecture {architecture!r}" if architecture != "clip" else "no vision encoder"
        raise MmprojError(f"--mmproj {name!r} is not a vision mmproj file ({what}); --model-id takes the "
                          "language model's GGUF, --mmproj the vision tower's")
    projector_type = _projector_type(reader)
    if projector_type not in PROJECTORS:
        served = "; ".join(f"{p.projector_type} ({p.label})" for p in PROJECTORS.values())
        raise MmprojError(f"--mmproj {name!r} holds projector type {projector_type!r}, which is not served; "
                          f"served: {served}")
    projector = PROJECTORS[projector_type]

    def optional(key: str) -> Any:
        return _field(reader, key)

    def required(key: str) -> Any:
        value = _field(reader, key)
        if value is None:
            raise MmprojError(f"--mmproj {name!r} lacks {key}, which the vision tower needs")
        return value

    activation = _activation(reader)
    if activation not in projector.activations:
        raise MmprojError(f"--mmproj {name!r}: {_FLAGS[activation]} is not served for {projector_type}")
    tensors = {tensor.name: tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors}
    projection = tensors.get(projector.projection)
    if projection is None or len(projection) != 2:
        raise MmprojError(f"--mmproj {name!r} has no connector projection ({projector.projection})")
    try:
        vision = projector.vision_config(required, optional, activation, tensors)
        scale_factor = projector.scale_factor(optional, vision, projection)
    except MmprojError as error:  # the projector's own messages, named by the file (required's already are)
        message = str(error)
        raise MmprojError(message if message.startswith("--mmproj") else f"--mmproj {name!r}: {message}") from None
    processor_config = projector.processor_config(required, optional, vision, scale_factor)
    width = int(_field(reader, "clip.vision.projection_dim", 0)) or projector.width(projection)
    _check_tensors(name, projector, tensors, projector.shape_config(PlainConfig(vision), scale_factor, width))
    return Mmproj(path, projector_type, vision, scale_factor, width, processor_config)


def gguf_names(projector: Projector, shapes: dict[str, tuple[int, ...]],
               num_layers: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter -> the file's tensors that make it (its name, its shape), by gguf-py's table
    of the converter (MODEL_ARCH.MMPROJ) and the projector's `parts`."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, num_layers)

    def gguf_name(name: str) -> str:
        stored = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if stored is None:
            raise MmprojError(f"gguf-py names no mmproj tensor for {name}")  # a gguf-py too old or too new
        return stored

    return {parameter: projector.parts(parameter, shape, gguf_name) for parameter, shape in shapes.items()}


def _check_tensors(name: str, projector: Projector, tensors: dict[str, tuple[int, ...]], config: Any) -> None:
    """Every tensor has its place and shape, and every parameter its tensors (the projection's
    width is checked against the text model's by vision_language_config)."""
    layout = gguf_names(projector, projector.expected_shapes(config), projector.block_count(config.vision_config))
    parts = {stored: shape for stored_parts in layout.values() for stored, shape in stored_parts}
    unknown = sorted(set(tensors) - set(parts))
    missing = sorted(stored for stored in parts if stored not in tensors)
    if unknown or missing:
        raise MmprojError(f"--mmproj {name!r} does not hold a {projector.projector_type} vision tower of its own "
                          f"metadata: {len(missing)} tensors missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                          f"(e.g. {unknown[:3]})")
    for stored, shape in parts.items():
        if tensors[stored] != shape:
            raise MmprojError(f"--mmproj {name!r}: tensor {stored} has shape {list(tensors[stored])}, its metadata "
                              f"says {list(shape)}")


def vision_language_config(text_config: Any, mmproj: Mmproj, tokenizer: Callable[[], Any],
                           text_name: str) -> PlainConfig:
    """The composite model's config (as a checkpoint's config.json would be, for the native class of
    the projector type) around the text GGUF's config; `tokenizer()` gives the text GGUF's, which
    names the image token. Refuses a text model the tower does not project to, or one without the
    token."""
    projector = mmproj.projector
    name = os.path.basename(mmproj.path)
    hidden = int(text_config.hidden_size)
    if mmproj.projection_dim != hidden:
        raise MmprojError(f"--mmproj {name!r} projects images to width {mmproj.projection_dim}, but the language "
                          f"model {text_name!r} has hidden size {hidden}: not the same model's pair")
    vocab = tokenizer().get_vocab()  # transformers' or a ServingTokenizer
    return PlainConfig({
        "model_type": projector.model_type, "architectures": [projector.architecture],
        "text_config": text_config, "vision_config": PlainConfig(mmproj.vision),
        **projector.composite(mmproj.vision, mmproj.scale_factor, vocab, text_name),
        "tie_word_embeddings": bool(getattr(text_config, "tie_word_embeddings", projector.tied_by_default)),
        "eos_token_id": getattr(text_config, "eos_token_id", None),
        "bos_token_id": getattr(text_config, "bos_token_id", None),
        "processor_config": mmproj.processor_config,
    })


class MmprojWeights:
    """The file's tensors as (our name, float32 tensor, the converter's changes undone: a tensor it
    split put back together from its parts), for the composite model of `vision_language_config`
    (read_mmproj checked the file against it at start; the projector type is the file's).
    `names`: the file's tensor name -> our parameter it makes (or makes part of)."""

    def __init__(self, path: str, config: Any):
        self.path = path
        self.projector = PROJECTORS[_projector_type(_reader(path))]
        shapes = self.projector.expected_shapes(config)
        self.parts = {parameter: [stored for stored, _ in parts] for parameter, parts in
                      gguf_names(self.projector, shapes, self.projector.block_count(config.vision_config)).items()}
        self.names = {stored: parameter for parameter, parts in self.parts.items() for stored in parts}

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        pending: dict[str, dict[str, torch.Tensor]] = {}  # parameter -> its parts read so far
        for tensor in GGUFReader(self.path).tensors:
            values = dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            parameter = self.names[tensor.name]
            read = pending.setdefault(parameter, {})
            read[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
            if len(read) == len(self.parts[parameter]):
                del pending[parameter]
                yield parameter, self.projector.from_stored(parameter, [read[n] for n in self.parts[parameter]])
