"""A pre-quantized Hub checkpoint's safetensors, read as (HF name, tensor or QuantizedWeight): each
quantized layer's tensors (qweight, qzeros, scales, g_idx / weight_packed, weight_scale, ...) are
gathered, converted (gptq.py, compressed.py) and yielded once as `<layer>.weight`; every other
tensor (norms, embeddings, a float head, biases) comes as it is."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Iterator, Mapping

import torch

from ..methods import detect
from ..weight import QuantizedWeight
from .compressed import compressed_layer
from .gptq import awq_layer, gptq_layer

logger = logging.getLogger(__name__)

# method -> (the suffix that marks a quantized layer, the suffixes of its tensors, the converter)
Layer = Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], str], QuantizedWeight]
LAYOUTS: dict[str, tuple[str, tuple[str, ...], Layer]] = {
    "gptq": ("qweight", ("qweight", "qzeros", "scales", "g_idx"), gptq_layer),
    "awq": ("qweight", ("qweight", "qzeros", "scales"), awq_layer),
    "compressed-tensors": ("weight_scale", ("weight_packed", "weight", "weight_scale", "weight_zero_point",
                                            "weight_shape", "weight_g_idx"), compressed_layer),
}


class HubQuantizedWeights:
    """Iteration yields the checkpoint's tensors with each quantized layer as one QuantizedWeight."""

    @staticmethod
    def reads(quantization_config: Mapping[str, Any] | None) -> bool:
        """Whether this reader reads a checkpoint of this quantization_config (None: a float one)."""
        method = detect(dict(quantization_config)) if quantization_config else None
        return method is not None and method.name in (*LAYOUTS, "marlin")

    def __init__(self, files: list[str], quantization_config: Mapping[str, Any]):
        from safetensors import safe_open

        self.files, self.config = files, dict(quantization_config)
        method = detect(self.config)
        self.method = "gptq" if method.name == "marlin" else method.name
        self.marker, self.suffixes, self.convert = LAYOUTS[self.method]
        names = []
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                names += list(f.keys())
        self.layers = {name[:-len(self.marker)] for name in names if name.endswith("." + self.marker)}
        # how many tensors each quantized layer has (its prefix -> count), to know when it is complete
        self.expected = Counter(self._split(name)[0] for name in names if self._split(name) is not None)
        self.count = len(names) - sum(self.expected.values()) + len(self.expected)

    def _split(self, name: str) -> tuple[str, str] | None:
        prefix, _, suffix = name.rpartition(".")
        prefix += "."
        return (prefix, suffix) if prefix in self.layers and suffix in self.suffixes else None

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        from ...loader.safetensors_weights import iterate_safetensors

        pending: dict[str, dict[str, torch.Tensor]] = {}
        formats: Counter = Counter()
        for name, tensor in iterate_safetensors(self.files):
            split = self._split(name)
            if split is None:
                yield name, tensor
                continue
            prefix, suffix = split
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if len(parts) == self.expected[prefix]:
                what = f"{self.method} layer {prefix}weight"
                try:
                    weight = self.convert(pending.pop(prefix), self.config, what)
                except KeyError as missing:
                    raise ValueError(f"{what}: the checkpoint has no {prefix}{missing.args[0]}") from None
                formats[weight.format + (" act-order" if weight.input_order is not None else "")] += 1
                yield prefix + "weight", weight
        logger.info("%s checkpoint: %s", self.method, ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())))
