"""How a model turns a prompt's hidden states into one embedding: decided once per model
(decide.py), carried by the loaded model and by EngineInfo to the gateway. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from .params import PoolingParams

TASKS = ("auto", "generate", "embed")  # how a model is served (--task; decide.py decides "auto")
POOLING_METHODS = ("last", "mean", "cls")
_METHOD_WORDS = {"last": "last-token", "mean": "mean", "cls": "CLS"}


@dataclass(frozen=True)
class PoolingSpec:
    """`method`: the hidden state of the last token (decoders such as Qwen3-Embedding), the
    mean over the prompt, or the first token's (BERT's [CLS]). `normalize`: L2-normalise, as
    the model's sentence-transformers Normalize module says (llama.cpp's and vLLM's default
    without one). `size`: the embedding's length (the hidden size). `matryoshka`: whether the
    model was trained so that its embedding may be cut to fewer dimensions, and to which
    (`matryoshka_dimensions`; empty: any). `origin`: what decided it, for the start log."""

    method: str
    normalize: bool
    size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    origin: str = ""

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method {self.method!r} is not one of {', '.join(POOLING_METHODS)}")

    def check(self, params: PoolingParams) -> None:
        """Raises ValidationError (param `dimensions`) when the model cannot give what `params` ask."""
        dimensions = params.dimensions
        if dimensions is None or dimensions == self.size:
            return
        if not self.matryoshka:
            raise ValidationError(f"this model does not support Matryoshka embeddings: `dimensions` must be left out "
                                  f"or equal its embedding size ({self.size})", "dimensions")
        if dimensions > self.size:
            raise ValidationError(f"dimensions ({dimensions}) exceeds the model's embedding size ({self.size})",
                                  "dimensions")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(str(d) for d in self.matryoshka_dimensions)
            raise ValidationError(f"dimensions must be one of the sizes this model was trained for: {sizes}",
                                  "dimensions")

    def normalizes(self, params: PoolingParams) -> bool:
        return self.normalize if params.normalize is None else params.normalize

    def describe(self) -> str:
        words = f"{_METHOD_WORDS[self.method]} pooling, {'L2-normalised' if self.normalize else 'not normalised'}"
        if self.matryoshka:
            words += ", Matryoshka"
        return f"embeddings of {self.size} dimensions ({words}; from {self.origin or 'defaults'})"
