"""The one table of quantization methods (vLLM's QuantizationConfig classes, as data).

Each method declares where its weights come from, which checkpoint keys it reads, which layers it
replaces and which backends run it. `--quantize` validation (apply.py), checkpoint detection
(a Hub checkpoint's `quantization_config`), each backend's `Capabilities.quantizations` and
`switchyard backends` all read this table, so a method is added in one place.

Sources:
- "gguf": a GGUF file's own blocks, read packed from the mapped file (core/loader/gguf_packed.py).
- "checkpoint": a pre-quantized Hub checkpoint (GPTQ, AWQ, ...), detected from its
  `quantization_config` and converted at load into a QuantizedWeight format.
- "at-load": a float checkpoint quantized while loading (--quantize int8, int4, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..params import ValidationError

SOURCES = ("gguf", "checkpoint", "at-load")


class QuantizeError(ValidationError):
    """A --quantize value, or a checkpoint's quantization, that does not fit (one line for the user)."""

    def __init__(self, message: str):
        super().__init__(message, "quantize")


@dataclass(frozen=True)
class QuantMethod:
    name: str  # the --quantize value (TGI's name where TGI has one)
    source: str  # one of SOURCES
    summary: str  # one line: what it is and how it is served
    formats: tuple[str, ...] = ()  # the QuantizedWeight formats it yields (core/quant/weight.py)
    checkpoint_keys: tuple[str, ...] = ()  # per-layer tensor suffixes it reads ("qweight", "scales", ...)
    replaces: tuple[str, ...] = ("Linear",)  # core layer classes whose weight it replaces
    backends: tuple[str, ...] = ()  # backend names that serve it; empty: refused everywhere
    config_methods: tuple[str, ...] = ()  # quantization_config["quant_method"] values that mean it
    refusal: str | None = None  # why it is not served (where `backends` is empty or lacks one)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"quantization method {self.name!r}: source {self.source!r} is not one of {SOURCES}")

    def describe(self) -> str:
        where = ", ".join(self.backends) if self.backends else "no backend"
        return f"{self.name} ({self.source}; {where}): {self.summary}"


METHODS: dict[str, QuantMethod] = {}


def register(method: QuantMethod) -> QuantMethod:
    if method.name in METHODS:
        raise ValueError(f"quantization method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def served_by(backend: str) -> tuple[str, ...]:
    """The --quantize names `backend` serves (its Capabilities.quantizations)."""
    return tuple(name for name, method in METHODS.items() if backend in method.backends)


def lookup(name: str) -> QuantMethod:
    """The method named by --quantize; an unknown name is refused with the known ones listed."""
    if name not in METHODS:
        raise QuantizeError(f"--quantize {name} is not a quantization method; known: {', '.join(METHODS)}")
    return METHODS[name]


def detect(quantization_config: Mapping[str, Any] | None) -> QuantMethod | None:
    """The method a checkpoint's `quantization_config` (config.json) names, or None for a float
    checkpoint. A quant_method no entry claims is refused with one line."""
    if not quantization_config:
        return None
    quant_method = str(quantization_config.get("quant_method", "")).lower()
    for method in METHODS.values():
        if quant_method in method.config_methods:
            return method
    known = sorted(m for method in METHODS.values() for m in method.config_methods)
    raise QuantizeError(f"checkpoint quantization {quant_method or '(no quant_method)'!r} is not supported; "
                        f"supported checkpoint quantizations: {', '.join(known) or '(none)'}")


def table() -> str:
    """One line per method (`switchyard backends`)."""
    return "\n".join(method.describe() for method in METHODS.values())


register(QuantMethod(
    "gguf", "gguf", "a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) multiplied "
    "packed; other GGUF types dequantized per matrix", formats=("q4_0", "q4_1", "q8_0"),
    replaces=("Linear", "Embedding"), backends=("cpu",)))
register(QuantMethod("int8", "at-load", "symmetric per-output-channel int8 weights, made at load",
                     formats=("int8",), backends=("cpu",)))
register(QuantMethod("int4", "at-load", "asymmetric int4 weights in groups of 32 (q4_1 blocks; the output head "
                     "int8), made at load", formats=("q4_1", "int8"), backends=("cpu",)))
