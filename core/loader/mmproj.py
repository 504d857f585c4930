"""llama.cpp's mmproj file: a vision-language model's vision tower and connector, kept apart from
its language model's GGUF (`--mmproj FILE` beside `--model-id TEXT.gguf`, as llama-server takes
`-m TEXT.gguf --mmproj MMPROJ.gguf`).

The language model loads as any GGUF does (its blocks packed, gguf_packed.py); this module reads
the other file, with the `gguf` package, and decides once, at start, everything the pair adds:
- the vision config, from the file's `clip.vision.*` metadata (what llama.cpp's converter,
  convert_hf_to_gguf.py, wrote from the checkpoint's config);
- the composite model's config around the text GGUF's (`vision_language_config`): the native
  class of its projector type, the image token's id in the text GGUF's tokenizer;
- how images are prepared (`processor_config`, laid out as a checkpoint's processor_config.json:
  core/multimodal/processor.py makes transformers' processor from it), since no processor files
  come with a GGUF pair;
- every tensor's place in our modules (core/models/siglip.py), by gguf-py's own name table (the
  converter's), and its shape, checked against the config and the text model.
Anything it cannot serve is refused in one line (MmprojError), before a weight is read. The weights
themselves (`MmprojWeights`) are dequantized from whatever type the file holds (F32, F16, BF16,
Q8_0, ...) to float32; the model copies them into its dtype.

Served projector types: SERVED_PROJECTORS (llama.cpp's `clip.projector_type`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..models.errors import UnsupportedModelError
from ..models.plain_config import PlainConfig

logger = logging.getLogger(__name__)

# clip.projector_type -> (the model_type that serves the pair, its architecture, its image token)
SERVED_PROJECTORS = {"idefics3": ("idefics3", "Idefics3ForConditionalGeneration", "<image>")}
# transformers' PIL resampling code of LANCZOS: Idefics3's processor default, and llama.cpp's
# resize for this projector (clip.cpp: RESIZE_ALGO_LANCZOS)
_LANCZOS = 1
# a file without clip.vision.preproc_image_size (older converters): transformers' Idefics3 default,
# an image resized to at most 4 tiles a side before it is cut (4 * 364 for 364-pixel tiles)
_DEFAULT_TILES_PER_SIDE = 4


class MmprojError(UnsupportedModelError):
    """An --mmproj file that cannot be served with this language model; the message is one line."""


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


def _required(reader: Any, path: str, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise MmprojError(f"--mmproj {os.path.basename(path)!r} lacks {key}, which the vision tower needs")
    return value


def _activation(reader: Any, path: str) -> str:
    """The vision MLP's activation, as clip.cpp reads it: gelu (ggml's, tanh-approximated), silu,
    else quick gelu."""
    if _field(reader, "clip.use_silu", False):
        raise MmprojError(f"--mmproj {os.path.basename(path)!r}: a SiLU vision MLP (clip.use_silu) is not served")
    return "gelu_pytorch_tanh" if _field(reader, "clip.use_gelu", False) else "quick_gelu"


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
    projector = _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")
    if projector not in SERVED_PROJECTORS:
        raise MmprojError(f"--mmproj {name!r} holds projector type {projector!r}, which is not served; "
                          f"served: {', '.join(sorted(SERVED_PROJECTORS))} (Idefics3, SmolVLM)")
    image_size = int(_required(reader, path, "clip.vision.image_size"))
    patch_size = int(_required(reader, path, "clip.vision.patch_size"))
    vision = {
        "model_type": "idefics3_vision", "num_channels": 3, "image_size": image_size, "patch_size": patch_size,
        "hidden_size": int(_required(reader, path, "clip.vision.embedding_length")),
        "intermediate_size": int(_required(reader, path, "clip.vision.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, path, "clip.vision.block_count")),
        "num_attention_heads": int(_required(reader, path, "clip.vision.attention.head_count")),
        "layer_norm_eps": float(_field(reader, "clip.vision.attention.layer_norm_epsilon", 1e-6)),
        "hidden_act": _activation(reader, path),
    }
    tensors = {tensor.name: tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors}
    scale_factor = _scale_factor(reader, name, vision, tensors)
    longest_edge = _field(reader, "clip.vision.preproc_image_size")
    if longest_edge is None:
        longest_edge = _DEFAULT_TILES_PER_SIDE * image_size
        logger.info("--mmproj %s has no clip.vision.preproc_image_size: images are resized to at most %d pixels "
                    "a side (transformers' Idefics3 default)", name, longest_edge)
    processor_config = {
        "image_processor": {
            "do_image_splitting": True, "resample": _LANCZOS,
            "size": {"longest_edge": int(longest_edge)}, "max_image_size": {"longest_edge": image_size},
            "image_mean": [float(v) for v in _required(reader, path, "clip.vision.image_mean")],
            "image_std": [float(v) for v in _required(reader, path, "clip.vision.image_std")]},
        "image_seq_len": (image_size // patch_size) ** 2 // scale_factor ** 2,
    }
    projection_dim = _check_tensors(name, tensors, PlainConfig(vision), scale_factor,
                                    int(_field(reader, "clip.vision.projection_dim", 0)))
    return Mmproj(path, projector, vision, scale_factor, projection_dim, processor_config)


def _scale_factor(reader: Any, name: str, vision: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> int:
    """The pixel shuffle's factor: the metadata's, else what the projection's input width implies."""
    fc = tensors.get("mm.model.fc.weight")
    if fc is None or len(fc) != 2:
        raise MmprojError(f"--mmproj {name!r} has no connector projection (mm.model.fc.weight)")
    value = _field(reader, "clip.vision.projector.scale_factor")
    if value is None:
        value = round((fc[1] / vision["hidden_size"]) ** 0.5)
    side = vision["image_size"] // vision["patch_size"]
    if value < 1 or side % value:
        raise MmprojError(f"--mmproj {name!r}: scale factor {value} does not divide the {side}x{side} patch grid")
    return int(value)


def expected_shapes(vision: Any, scale_factor: int, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """Our vision tower's and connector's parameters (Idefics3ForConditionalGeneration's names,
    `model.` first as a checkpoint has them) -> shape, from modules built on the meta device."""
    from ..models.siglip import PixelShuffleConnector, VisionTransformer

    with torch.device("meta"):
        modules = {"model.vision_model.": VisionTransformer(vision),
                   "model.connector.": PixelShuffleConnector(vision.hidden_size, text_hidden, scale_factor)}
    return {prefix + key: tuple(value.shape) for prefix, module in modules.items()
            for key, value in module.state_dict().items()}


def gguf_names(parameters: list[str], num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> our parameter name, by gguf-py's table of the converter (MODEL_ARCH.MMPROJ)."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, num_layers)
    names = {}
    for parameter in parameters:
        stored = table.get_name(parameter, try_suffixes=(".weight", ".bias"))
        if stored is None:
            raise MmprojError(f"gguf-py names no mmproj tensor for {parameter}")  # a gguf-py too old or too new
        names[stored] = parameter
    return names


def _check_tensors(name: str, tensors: dict[str, tuple[int, ...]], vision: Any, scale_factor: int,
                   projection_dim: int) -> int:
    """Every tensor has its place and shape, and every parameter its tensor; returns the width the
    connector projects to (the metadata's projection_dim, else its matrix's), to be checked against
    the text model's."""
    fc = tensors["mm.model.fc.weight"]
    width = projection_dim or fc[0]
    shapes = expected_shapes(vision, scale_factor, width)
    names = gguf_names(list(shapes), vision.num_hidden_layers)
    unknown = sorted(set(tensors) - set(names))
    missing = sorted(stored for stored in names if stored not in tensors)
    if unknown or missing:
        raise MmprojError(f"--mmproj {name!r} does not hold an idefics3 vision tower of its own metadata: "
                          f"{len(missing)} tensors missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                          f"(e.g. {unknown[:3]})")
    for stored, parameter in names.items():
        if tensors[stored] != shapes[parameter]:
            raise MmprojError(f"--mmproj {name!r}: tensor {stored} has shape {list(tensors[stored])}, its metadata "
                              f"says {list(shapes[parameter])}")
    return width


def vision_language_config(text_config: Any, mmproj: Mmproj, tokenizer: Callable[[], Any],
                           text_name: str) -> PlainConfig:
    """The composite model's config (as a checkpoint's config.json would be, for the native class of
    the projector type) around the text GGUF's config; `tokenizer()` gives the text GGUF's, which
    names the image token. Refuses a text model the tower does not project to, or one without the
    token."""
    model_type, architecture, image_token = SERVED_PROJECTORS[mmproj.projector_type]
    name = os.path.basename(mmproj.path)
    hidden = int(text_config.hidden_size)
    if mmproj.projection_dim != hidden:
        raise MmprojError(f"--mmproj {name!r} projects images to width {mmproj.projection_dim}, but the language "
                          f"model {text_name!r} has hidden size {hidden}: not the same model's pair")
    image_token_id = tokenizer().get_vocab().get(image_token)  # transformers' or a ServingTokenizer
    if image_token_id is None:
        raise MmprojError(f"the language model {text_name!r} has no {image_token} token in its tokenizer: "
                          f"not the language model of an {mmproj.projector_type} pair")
    return PlainConfig({
        "model_type": model_type, "architectures": [architecture],
        "text_config": text_config, "vision_config": PlainConfig(mmproj.vision),
        "scale_factor": mmproj.scale_factor, "image_token_id": image_token_id,
        "tie_word_embeddings": bool(getattr(text_config, "tie_word_embeddings", False)),
        "eos_token_id": getattr(text_config, "eos_token_id", None),
        "bos_token_id": getattr(text_config, "bos_token_id", None),
        "processor_config": mmproj.processor_config,
    })


class MmprojWeights:
    """The file's tensors as (our name, float32 tensor), for the composite model of
    `vision_language_config` (read_mmproj checked the file against it at start)."""

    def __init__(self, path: str, config: Any):
        self.path = path
        shapes = expected_shapes(config.vision_config, int(config.scale_factor), int(config.text_config.hidden_size))
        self.names = gguf_names(list(shapes), int(config.vision_config.num_hidden_layers))

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        for tensor in GGUFReader(self.path).tensors:
            values = dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            yield self.names[tensor.name], torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
