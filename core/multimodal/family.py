"""The base of every image family (families.py registers them): `Expansion`, what one image's
placeholder expands into, and `ImageFamily`, how one model family prepares an image. A module of
its own, importing nothing of the package, so that a family in its own module (qwen2_vl.py,
gemma3.py) and the registry that imports it (families.py) make no import cycle."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


def load_hf_processor(directory: str) -> Any:
    """transformers' processor saved with the model. Its image processor is the fast (torchvision)
    one where torchvision is installed, else transformers falls back to the PIL one (one warning).
    Nothing is downloaded."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory, local_files_only=True)


def load_pair_tokenizer(tokenizer_files: tuple[str, str | None], **options: Any) -> Any:
    """transformers' tokenizer of a GGUF pair's language model (`tokenizer_files`:
    ModelSource.tokenizer_files, the GGUF's converted tokenizer files or the GGUF itself), its
    tokenizer.json taken as it is: the pipeline the engine's own tokenizer runs (ServingTokenizer),
    not the one a class named by the architecture would rebuild (transformers' GemmaTokenizer for
    any gemma3 GGUF). `options` go to from_pretrained (Gemma 3's extra_special_tokens)."""
    from transformers import PreTrainedTokenizerFast

    directory, gguf_file = tokenizer_files
    return PreTrainedTokenizerFast.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}),
                                                   **options)


@dataclass(frozen=True)
class Expansion:
    """One image's placeholder, expanded: its token ids; which of them take the encoder's rows,
    in order (offsets into `tokens`); `grid`: the family's layout of those rows where positions
    depend on it (Qwen2-VL's M-RoPE: (t, h, w) after merging), else ()."""

    tokens: tuple[int, ...]
    embed_offsets: tuple[int, ...]
    grid: tuple[int, ...] = ()


class ImageFamily(ABC):
    """One family's image preparation, over the model's transformers processor. `placeholder` is
    the text one image stands for in a rendered prompt (what the chat template writes, what the
    gateway writes for a TGI markdown image); `placeholder_id` its token id."""

    placeholder: str
    placeholder_id: int

    def __init__(self, processor: Any):
        self.processor = processor

    @classmethod
    def load_processor(cls, directory: str) -> Any:
        """The processor this family runs, saved with the checkpoint in `directory`: transformers'
        AutoProcessor (load_hf_processor), unless the family says otherwise."""
        return load_hf_processor(directory)

    @classmethod
    def processor_from_config(cls, processor_config: dict[str, Any], tokenizer_files: tuple[str, str | None]) -> Any:
        """The processor for a model with no processor files (a GGUF pair): made as a checkpoint's
        processor_config.json makes it (`processor_config`, laid out for this family, is decided
        from the mmproj file's metadata: core/loader/mmproj_projectors.py), over the language
        model's own tokenizer (load_pair_tokenizer). A family served from no GGUF pair says so."""
        raise NotImplementedError(f"{cls.__name__} is not served from a GGUF + mmproj pair")

    @abstractmethod
    def prepare(self, image: Any, split: bool) -> tuple[Any, Expansion]:
        """(the image's frames, its Expansion); raises on an image the processor cannot read."""

    @abstractmethod
    def frames(self, image: Any, split: bool) -> Any:
        """The frames `prepare` gave for this image (equal to them)."""

    def joined(self, tokens: list[int], spans: list[Any]) -> tuple[list[int], list[Any]]:
        """The expanded prompt (its ImageSpans) as the model's own processor would tokenize it where
        an expansion's edge tokens merge with the text beside them (Gemma 3's newlines,
        gemma3.py); by default as it is."""
        return tokens, spans
