"""The base of the projector types an mmproj file may hold (llama.cpp's `clip.projector_type`):
`Projector`, what one type says (mmproj_projectors.py: Idefics3, Gemma 3; mmproj_qwen2_vl.py:
Qwen2-VL, Qwen2.5-VL; PROJECTORS registers them), and `MmprojError`. A module of its own,
importing none of them, so that the registry and the classes in their own modules make no
import cycle.

Each class says:
- the vision config (transformers' names, as a checkpoint's vision_config) from the file's
  `clip.vision.*` metadata (and, where the converter wrote no key for it, the file's tensor
  shapes), and the connector's scale factor;
- the shapes of our vision modules' parameters (built on the meta device), under the checkpoint
  names the native model's `route` takes, and for each the file's tensors that make it: the name
  llama.cpp's converter (convert_hf_to_gguf.py) looked up in gguf-py's MMPROJ table, the parts of
  a tensor it split, any value it changed;
- the width the connector projects to, from its matrix;
- how images are prepared (`processor_config`, as the family's processor from metadata takes it:
  core/multimodal/idefics3.py, gemma3.py, qwen2_vl.py);
- the composite model's config around the text GGUF's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from ..models.errors import UnsupportedModelError
from ..models.plain_config import PlainConfig

# transformers' PIL resampling codes (PILImageResampling)
LANCZOS, BILINEAR, BICUBIC = 1, 2, 3


class MmprojError(UnsupportedModelError):
    """An --mmproj file that cannot be served with this language model; the message is one line."""


Metadata = Callable[[str], Any]  # a clip.* key -> its value; raises MmprojError where it is required and absent
Shapes = dict[str, tuple[int, ...]]  # the file's tensor name -> its shape (as our parameter would have it)
Part = tuple[str, tuple[int, ...]]  # one tensor of the file: its name, its shape


class Projector(ABC):
    """One projector type. `model_type`, `architecture`: the native class that serves the pair;
    `image_token`: the token of the text tokenizer that takes the image rows; `tied_by_default`:
    the family's tie_word_embeddings where the text config says none; `activations`: the vision
    MLP activations (as the file's clip.use_gelu / clip.use_silu say, mmproj.py) it serves."""

    projector_type: str
    label: str  # the models it serves, for messages
    model_type: str
    architecture: str
    image_token: str
    tied_by_default: bool
    projection: str  # the GGUF name of the connector's matrix, whose shape gives the width
    activations: tuple[str, ...] = ("gelu_pytorch_tanh", "quick_gelu")

    @abstractmethod
    def vision_config(self, required: Metadata, optional: Metadata, activation: str,
                      tensors: Shapes) -> dict[str, Any]:
        """The vision config (a checkpoint's vision_config) from the clip.vision.* metadata (the
        tensors' shapes where the converter wrote no key)."""

    @abstractmethod
    def scale_factor(self, optional: Metadata, vision: dict[str, Any], projection: tuple[int, ...]) -> int:
        """The connector's factor (Idefics3's pixel shuffle, Gemma 3's pooling side, Qwen2-VL's merge)."""

    @abstractmethod
    def shape_config(self, vision: Any, scale_factor: int, text_hidden: int) -> PlainConfig:
        """The composite config the modules of `expected_shapes` are built from."""

    @abstractmethod
    def expected_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Our vision tower's and connector's parameters (checkpoint names `route` takes) -> shape."""

    @abstractmethod
    def width(self, projection: tuple[int, ...]) -> int:
        """The width the connector projects to, from its matrix's shape (as our parameter has it)."""

    def block_count(self, vision: Any) -> int:
        """The vision tower's blocks (gguf-py's name table is made for as many)."""
        return int(vision.num_hidden_layers)

    def lookup_name(self, parameter: str) -> str:
        """The name the converter looks up in gguf-py's table for our `parameter`."""
        return parameter

    def parts(self, parameter: str, shape: tuple[int, ...], gguf_name: Callable[[str], str]) -> list[Part]:
        """The file's tensors that make our `parameter` of `shape`, in the order `from_stored`
        takes them: one, gguf-py's name (`gguf_name`) of `lookup_name`, unless the converter
        split the tensor."""
        return [(gguf_name(self.lookup_name(parameter)), shape)]

    def from_stored(self, parameter: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """A tensor as our parameter takes it, from the file's values of its `parts` (the
        converter's changes undone)."""
        return parts[0]

    @abstractmethod
    def processor_config(self, required: Metadata, optional: Metadata, vision: dict[str, Any],
                         scale_factor: int) -> dict[str, Any]:
        """How images are prepared, as the family's processor_from_config takes it."""

    @abstractmethod
    def composite(self, vision: dict[str, Any], scale_factor: int, vocab: dict[str, int],
                  text_name: str) -> dict[str, Any]:
        """The composite config's own keys (besides text_config, vision_config, the common ids):
        the image token's id and the family's keys; refuses a tokenizer without the tokens."""

    def token_id(self, vocab: dict[str, int], token: str, text_name: str) -> int:
        token_id = vocab.get(token)
        if token_id is None:
            raise MmprojError(f"the language model {text_name!r} has no {token} token in its tokenizer: "
                              f"not the language model of this pair ({self.projector_type} mmproj)")
        return int(token_id)


def normalization(required: Metadata) -> dict[str, Any]:
    """The image processor's mean and std, as the converter wrote the checkpoint's."""
    return {"image_mean": [float(v) for v in required("clip.vision.image_mean")],
            "image_std": [float(v) for v in required("clip.vision.image_std")]}
