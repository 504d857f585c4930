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
- every tensor's place in our modules (core/models/siglip.py, gemma3_vision.py), by gguf-py's own
  name table (the converter's), and its shape, checked against the config and the text model.
What differs between projector types is said by one class each (mmproj_projectors.py, PROJECTORS,
picked here by `clip.projector_type`).
Anything it cannot serve is refused in one line (MmprojError), before a weight is read. The weights
themselves (`MmprojWeights`) are dequantized from whatever type the file holds (F32, F16, BF16,
Q8_0, ...) to float32, any value the converter changed changed back; the model copies them into
its dtype.

Served projector types: PROJECTORS (llama.cpp's `clip.projector_type`): idefics3, gemma3.
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


def _activation(reader: Any, path: str) -> str:
    """The vision MLP's activation, as clip.cpp reads it: gelu (ggml's, tanh-approximated), silu,
    else quick gelu."""
    if _field(reader, "clip.use_silu", False):
        raise MmprojError(f"--mmproj {os.path.basename(path)!r}: a SiLU vision MLP (clip.use_silu) is not served")
    return "gelu_pytorch_tanh" if _field(reader, "clip.use_gelu", False) else "quick_gelu"


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

    vision = projector.vision_config(required, optional, _activation(reader, path))
    tensors = {tensor.name: tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors}
    projection = tensors.get(projector.projection)
    if projection is None or len(projection) != 2:
        raise MmprojError(f"--mmproj {name!r} has no connector projection ({projector.projection})")
    try:
        scale_factor = projector.scale_factor(optional, vision, projection)
    except MmprojError as error:
        raise MmprojError(f"--mmproj {name!r}: {error}") from None
    processor_config = projector.processor_config(required, optional, vision, scale_factor)
    width = int(_field(reader, "clip.vision.projection_dim", 0)) or projector.width(projection)
    _check_tensors(name, projector, tensors, projector.shape_config(PlainConfig(vision), scale_factor, width))
    return Mmproj(path, projector_type, vision, scale_factor, width, processor_config)


def gguf_names(projector: Projector, parameters: list[str], num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> our parameter name, by gguf-py's table of the converter (MODEL_ARCH.MMPROJ)."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, num_layers)
    names = {}
    for parameter in parameters:
        stored = table.get_name(projector.lookup_name(parameter), try_suffixes=(".weight", ".bias"))
        if stored is None:
            raise MmprojError(f"gguf-py names no mmproj tensor for {parameter}")  # a gguf-py too old or too new
        names[stored] = parameter
    return names


def _check_tensors(name: str, projector: Projector, tensors: dict[str, tuple[int, ...]], config: Any) -> None:
    """Every tensor has its place and shape, and every parameter its tensor (the projection's
    width is checked against the text model's by vision_language_config)."""
    shapes = projector.expected_shapes(config)
    names = gguf_names(projector, list(shapes), config.vision_config.num_hidden_layers)
    unknown = sorted(set(tensors) - set(names))
    missing = sorted(stored for stored in names if stored not in tensors)
    if unknown or missing:
        raise MmprojError(f"--mmproj {name!r} does not hold a {projector.projector_type} vision tower of its own "
                          f"metadata: {len(missing)} tensors missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                          f"(e.g. {unknown[:3]})")
    for stored, parameter in names.items():
        if tensors[stored] != shapes[parameter]:
            raise MmprojError(f"--mmproj {name!r}: tensor {stored} has shape {list(tensors[stored])}, its metadata "
                              f"says {list(shapes[parameter])}")


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
    """The file's tensors as (our name, float32 tensor, the converter's changes undone), for the
    composite model of `vision_language_config` (read_mmproj checked the file against it at start;
    the projector type is the file's)."""

    def __init__(self, path: str, config: Any):
        self.path = path
        self.projector = PROJECTORS[_projector_type(_reader(path))]
        shapes = self.projector.expected_shapes(config)
        self.names = gguf_names(self.projector, list(shapes), int(config.vision_config.num_hidden_layers))

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        for tensor in GGUFReader(self.path).tensors:
            values = dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            parameter = self.names[tensor.name]
            values = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
            yield parameter, self.projector.from_stored(parameter, values)
