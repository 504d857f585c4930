"""The one table of quantization methods (vLLM's QuantizationConfig classes, as data).

Each row holds only what is decided from it, each field read where its one decision is made:
- `name`, `source`, `alias_of`: `served_method` (core/quant/choice.py: the --quantize value
  validated against the model, and what it is served as);
- `config_methods`: `detect` (a Hub checkpoint's `quantization_config` to its method);
- `backends`: `served_by` (each backend's `Capabilities.quantizations`);
- `summary` (with name, source and backends): `table` (`switchyard backends`), and the start log.
What a method's checkpoint holds (tensor names, formats) is its reader's (core/quant/hub), and
which layers its weights replace is the backends' (`prepare_model`). tests/core/test_quant_methods.py
fails on a field nothing reads.

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
    backends: tuple[str, ...] = ()  # backend names that serve it; empty: refused everywhere
    config_methods: tuple[str, ...] = ()  # quantization_config["quant_method"] values that mean it
    # what this name stands for here: the checkpoint methods it accepts (TGI's marlin: gptq, awq), or
    # the at-load method that makes it (TGI's eetq: int8)
    alias_of: tuple[str, ...] = ()

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
    quant_method = config_method(quantization_config)
    for method in METHODS.values():
        if quant_method in method.config_methods:
            return method
    known = sorted(m for method in METHODS.values() for m in method.config_methods)
    raise QuantizeError(f"checkpoint quantization {quant_method or '(no quant_method)'!r} is not supported; "
                        f"supported checkpoint quantizations: {', '.join(known) or '(none)'}")


def config_method(quantization_config: Mapping[str, Any]) -> str:
    """What config_methods match: quant_method, refined where one covers several methods here:
    bitsandbytes' 4-bit checkpoints by bnb_4bit_quant_type ("bitsandbytes-nf4" / "bitsandbytes-fp4";
    load_in_8bit stays "bitsandbytes"), and compressed-tensors whose every scheme has float8
    weights ("compressed-tensors-fp8", served by fp8)."""
    quant_method = str(quantization_config.get("quant_method", "")).lower()
    if quant_method == "bitsandbytes" and quantization_config.get("load_in_4bit"):
        return "bitsandbytes-" + str(quantization_config.get("bnb_4bit_quant_type") or "fp4").lower()
    groups = quantization_config.get("config_groups") or {}
    if quant_method == "compressed-tensors" and groups and all(
            (scheme.get("weights") or {}).get("type") == "float" and (scheme.get("weights") or {}).get("num_bits") == 8
            for scheme in groups.values()):
        return "compressed-tensors-fp8"
    return quant_method


NONE = "none"  # --quantize none: a GGUF file's weights dequantized into --dtype (no method)


def table() -> str:
    """One line per method (`switchyard backends`)."""
    return "\n".join(method.describe() for method in METHODS.values())


register(QuantMethod(
    "gguf", "gguf", "a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) multiplied "
    "packed; other GGUF types dequantized per matrix", backends=("cpu", "cuda", "rocm")))
register(QuantMethod("int8", "at-load", "symmetric per-output-channel int8 weights, made at load",
                     backends=("cpu", "cuda", "rocm")))
register(QuantMethod("int4", "at-load", "asymmetric int4 weights in groups of 32 (q4_1 blocks; the output head "
                     "int8), made at load", backends=("cpu", "cuda", "rocm")))

# Pre-quantized Hub checkpoints, converted at load into block formats (core/quant/hub).
register(QuantMethod("gptq", "checkpoint", "GPTQ 4-bit (groups of 32/64/128 or per channel, act-order, "
                     "asymmetric) and 8-bit symmetric checkpoints, repacked at load into q4_0/q4_1/q8_0/int8",
                     backends=("cpu", "cuda", "rocm"), config_methods=("gptq",)))
register(QuantMethod("awq", "checkpoint", "AWQ 4-bit checkpoints in AutoAWQ's GEMM layout, repacked at load into q4_1",
                     backends=("cpu", "cuda", "rocm"), config_methods=("awq",)))
register(QuantMethod("marlin", "checkpoint", "TGI's name for GPTQ/AWQ checkpoints on the Marlin GPU kernel: a plain "
                     "GPTQ or AWQ checkpoint is served as gptq / awq; a Marlin-format checkpoint is refused",
                     backends=("cpu", "cuda"), config_methods=("marlin",), alias_of=("gptq", "awq")))
register(QuantMethod("compressed-tensors", "checkpoint", "llm-compressor's weight-only int schemes (W4A16, "
                     "W4A16_ASYM, W8A16; pack-quantized or naive-quantized), repacked at load into q4_0/q4_1/q8_0/int8",
                     backends=("cpu", "cuda", "rocm"), config_methods=("compressed-tensors",)))
register(QuantMethod("eetq", "at-load", "TGI's on-the-fly int8 weight-only quantization; served as --quantize int8",
                     backends=("cpu", "cuda", "rocm"), alias_of=("int8",)))

# bitsandbytes and float8 (core/quant/scaled.py; checkpoints read by core/quant/hub/bnb.py and fp8.py).
# Made at load from a float checkpoint, as TGI's --quantize does, or read from a pre-quantized one.
register(QuantMethod("bitsandbytes", "at-load", "LLM.int8: int8 rows with an absmax each, multiplied by bitsandbytes' "
                     "own int8 ops (activations rounded to int8 per row, input columns with a value over 6.0 kept "
                     "in floats); made at load by bitsandbytes, or read from a load_in_8bit checkpoint",
                     backends=("cpu", "cuda"), config_methods=("bitsandbytes",)))
register(QuantMethod("bitsandbytes-nf4", "at-load", "bitsandbytes NF4: 4-bit normal-float codes with an absmax per "
                     "64 weights, multiplied by bitsandbytes' own 4-bit ops (its CPU kernel, bf16 activations, "
                     "over the weight as it repacks it; batches over 8 rows dequantized per call); made at load "
                     "by bitsandbytes, or read from a load_in_4bit checkpoint",
                     backends=("cpu", "cuda"), config_methods=("bitsandbytes-nf4",)))
register(QuantMethod("bitsandbytes-fp4", "at-load", "bitsandbytes FP4: as bitsandbytes-nf4 with 4-bit float (e2m1) "
                     "codes", backends=("cpu", "cuda"), config_methods=("bitsandbytes-fp4",)))
register(QuantMethod("fp8", "at-load", "float8 e4m3 weights (weight-only: activations stay in --dtype, a checkpoint's "
                     "input scales unused), scaled per tensor, per channel or per 128x128 block (compressed-tensors "
                     "FP8, DeepSeek-V3 / Qwen3 FP8), 1 byte a weight, each block dequantized inside the CPU kernel; "
                     "made at load per channel, or read from an FP8 checkpoint",
                     backends=("cpu", "cuda"), config_methods=("fp8", "compressed-tensors-fp8")))
