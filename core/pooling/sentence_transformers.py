"""What a sentence-transformers model directory says about pooling: modules.json (the module
chain) and the Pooling module's config.json, in both the old format ("pooling_mode_lasttoken":
true, ...) and sentence-transformers 5+'s ("pooling_mode": "lasttoken"). Read, never imported."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..models.errors import UnsupportedModelError

# sentence-transformers' pooling modes -> ours; the others are refused
_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls"}
# modules that change nothing we compute (the transformer itself, the pooling read here, normalisation)
_UNDERSTOOD = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceTransformersPooling:
    method: str | None  # "last" | "mean" | "cls"; None: the directory has no Pooling module
    normalize: bool  # a Normalize module follows the pooling


def read_sentence_transformers(directory: str) -> SentenceTransformersPooling | None:
    """The directory's pooling, or None when it is not a sentence-transformers model. A module
    chain this engine would compute differently (Dense projections, max pooling, ...) is
    refused (UnsupportedModelError): serving it without them would give other embeddings."""
    modules_file = os.path.join(directory, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as file:
        modules = json.load(file)
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    unknown = [kind for kind, _ in kinds if kind not in _UNDERSTOOD]
    if unknown:
        raise UnsupportedModelError(f"the sentence-transformers model in {directory} has modules Switchyard does "
                                    f"not compute ({', '.join(unknown)}); it serves Transformer, Pooling and "
                                    "Normalize")
    method = None
    for kind, path in kinds:
        if kind == "Pooling":
            method = _pooling_method(os.path.join(directory, path, "config.json"))
    return SentenceTransformersPooling(method, normalize=any(kind == "Normalize" for kind, _ in kinds))


def _pooling_method(config_file: str) -> str:
    with open(config_file) as file:
        config = json.load(file)
    mode = config.get("pooling_mode")
    if mode is not None:  # sentence-transformers 5+: a name, or a list of names
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [key.removeprefix("pooling_mode_") for key, on in config.items()
                 if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise UnsupportedModelError(f"sentence-transformers pooling {modes or 'none'} ({config_file}) is not served; "
                                    "Switchyard pools by last token, mean or CLS, one of them")
    return _MODES[modes[0]]
