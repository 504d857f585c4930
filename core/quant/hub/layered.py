"""A weights reader for checkpoints whose quantized layers are several tensors under one layer
name (bitsandbytes: `weight`, `weight.absmax`, `weight.quant_state.*`, ...; FP8: `weight`,
`weight_scale`): each layer's tensors are gathered, converted once into `<layer>.weight`, and
every other tensor comes as it is. A `Layout` says which names belong to a quantized layer and
how one is converted; files may be sharded (a layer's tensors in different files)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from ..weight import QuantizedWeight

logger = logging.getLogger(__name__)

Converted = torch.Tensor | QuantizedWeight


class Layout(Protocol):
    what: str  # for the log line ("bitsandbytes", "fp8")

    def layers(self, names: set[str], tensors: Callable[[str], Any]) -> set[str]:
        """The layer prefixes ("model.layers.0.mlp.down_proj.") of the quantized layers; `tensors`
        gives a name's dtype-only view (safe_open slices), to tell float8 weights apart."""

    def part(self, name: str, prefix: str) -> str | None:
        """The part of layer `prefix` that `name` is ("weight", "weight.absmax", ...), or None."""

    def convert(self, prefix: str, parts: Mapping[str, torch.Tensor]) -> list[tuple[str, Converted]]:
        """The layer's tensors as the model loads them (usually one `<prefix>weight`)."""


class LayeredWeights:
    """Iteration yields (HF name, tensor or QuantizedWeight): quantized layers converted by `layout`."""

    def __init__(self, files: list[str], layout: Layout):
        from safetensors import safe_open

        self.files, self.layout = files, layout
        slices: dict[str, Any] = {}
        names: list[str] = []
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    names.append(name)
                    slices[name] = f.get_slice(name).get_dtype()
        self.prefixes = layout.layers(set(names), slices.__getitem__)
        self.expected: Counter = Counter()
        for name in names:
            prefix = self._layer(name)
            if prefix is not None:
                self.expected[prefix] += 1
        self.count = len(names) - sum(self.expected.values()) + len(self.expected)

    def _layer(self, name: str) -> str | None:
        head = name
        while "." in head:
            head = head.rpartition(".")[0]
            prefix = head + "."
            if prefix in self.prefixes:
                return prefix if self.layout.part(name, prefix) is not None else None
        return None

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[str, Converted]]:
        from ...loader.safetensors_weights import iterate_safetensors

        pending: dict[str, dict[str, torch.Tensor]] = {}
        kinds: Counter = Counter()
        for name, tensor in iterate_safetensors(self.files):
            prefix = self._layer(name)
            if prefix is None:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[self.layout.part(name, prefix)] = tensor
            if len(parts) == self.expected[prefix]:
                for out_name, out in self.layout.convert(prefix, pending.pop(prefix)):
                    kinds[out.format if isinstance(out, QuantizedWeight) else f"{out.dtype} (read as floats)"] += 1
                    yield out_name, out
        logger.info("%s checkpoint: %s", self.layout.what, ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
