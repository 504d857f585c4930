"""The one decision of how a model is served: generation, or embeddings and how it pools.

`--task` (ModelConfig.task, vLLM's `--task` / `--runner pooling`): "generate", "embed", or
"auto", where the model's own files decide: an encoder (BERT, XLM-R, ModernBERT) embeds; so does a
sentence-transformers directory (modules.json) or a GGUF whose `pooling_type` is mean, CLS or
last; anything else generates. Under "embed" the pooling comes from, in this order:
`--pooling` (ModelConfig.pooling), the sentence-transformers Pooling module, the GGUF's
`pooling_type`, else for an encoder its config's `classifier_pooling` where it has one
(ModernBERT's "mean" or "cls": how its classification head pools, a hint for a checkpoint
without sentence-transformers files), else CLS for an encoder and the last token for a decoder
(vLLM's defaults).
Normalisation: the sentence-transformers Normalize module where the model has such files, else
on (llama.cpp's and vLLM's default). Matryoshka: the config's `is_matryoshka` /
`matryoshka_dimensions` (vLLM reads the same keys)."""
from __future__ import annotations

from typing import Any

from ..models.errors import UnsupportedModelError
from .gguf_pooling import gguf_pooling_type
from .sentence_transformers import read_sentence_transformers
from .spec import POOLING_METHODS, TASKS, PoolingSpec
_GGUF_EMBEDDING = ("mean", "cls", "last")


def decide_pooling(task: str, pooling: str | None, hf_config: Any, encoder: bool,
                   directory: str | None = None, gguf_file: str | None = None) -> PoolingSpec | None:
    """The model's PoolingSpec when it is served for embeddings, None when it generates.
    `directory`: a Hugging Face model directory (its sentence-transformers files are read);
    `gguf_file`: a GGUF file (its header's pooling_type is read); `encoder`: the model is an
    encoder (models/__init__.py ENCODER_TYPES), which cannot generate."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if pooling is not None and pooling not in POOLING_METHODS:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLING_METHODS)}")
    name = _name(hf_config)
    if task == "generate":
        if encoder:
            raise UnsupportedModelError(f"model {name} ({hf_config.model_type}) is an encoder-only model: it serves "
                                        "embeddings (--task embed or auto), it cannot generate text")
        return None
    st = read_sentence_transformers(directory) if directory is not None else None
    gguf = gguf_pooling_type(gguf_file) if gguf_file is not None else None
    if gguf == "rank":
        raise UnsupportedModelError(f"GGUF {gguf_file} is a reranker (pooling_type rank), which is not served")
    if task == "auto" and not (encoder or st is not None or gguf in _GGUF_EMBEDDING):
        return None
    method, origin = _method(pooling, st, gguf, encoder, hf_config)
    normalize = st.normalize if st is not None else True
    return PoolingSpec(method, normalize, int(hf_config.hidden_size), *_matryoshka(hf_config), origin=origin)


def _method(pooling: str | None, st, gguf: str | None, encoder: bool, hf_config: Any) -> tuple[str, str]:
    if pooling is not None:
        return pooling, "--pooling"
    if st is not None and st.method is not None:
        return st.method, "sentence-transformers config"
    if gguf in _GGUF_EMBEDDING:
        return gguf, "GGUF pooling_type"
    if encoder and (hint := getattr(hf_config, "classifier_pooling", None)) in ("mean", "cls"):
        return hint, "config classifier_pooling"
    return ("cls", "encoder default") if encoder else ("last", "decoder default")


def _matryoshka(hf_config: Any) -> tuple[bool, tuple[int, ...]]:
    dimensions = tuple(int(d) for d in (getattr(hf_config, "matryoshka_dimensions", None) or ()))
    return bool(getattr(hf_config, "is_matryoshka", False)) or bool(dimensions), dimensions


def _name(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else str(getattr(hf_config, "model_type", None))
