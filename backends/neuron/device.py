"""What the Neuron backend asks of the machine, behind one object (tests fake it).

NeuronHost answers from the real machine: the /dev/neuron* device files, whether
torch_neuronx imports (the registry's torch-neuronx is a placeholder whose import raises),
and where the neuronx-cc compiler is. The runtime itself is torch_xla (PJRT "NEURON").
"""
from __future__ import annotations

import glob
import importlib
import shutil
from dataclasses import dataclass

# The Neuron SDK's default persistent compile cache (neuronx-cc writes its NEFFs here).
DEFAULT_COMPILE_CACHE = "/var/tmp/neuron-compile-cache"


class NeuronHost:
    """The real machine."""

    def devices(self) -> list[str]:
        return sorted(glob.glob("/dev/neuron[0-9]*"))

    def torch_neuronx_error(self) -> str | None:
        """None when torch_neuronx imports; else why not."""
        try:
            importlib.import_module("torch_neuronx")
        except Exception as error:  # the placeholder raises ImportError("WRONG PACKAGE ...")
            return f"torch_neuronx not importable: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        return None

    def compiler(self) -> str | None:
        return shutil.which("neuronx-cc")


@dataclass(frozen=True)
class NeuronProbe:
    """Everything probe() found, and the one-line verdict."""

    devices: tuple[str, ...]
    torch_neuronx_error: str | None
    compiler: str | None

    @classmethod
    def of(cls, host: NeuronHost) -> NeuronProbe:
        devices = tuple(host.devices())
        # importing torch_neuronx starts torch_xla: only worth it on a machine with devices
        error = host.torch_neuronx_error() if devices else "not checked (no device)"
        return cls(devices, error, host.compiler())

    @property
    def usable(self) -> bool:
        return bool(self.devices) and self.torch_neuronx_error is None and self.compiler is not None

    def reason(self) -> str:
        if self.usable:
            return f"{len(self.devices)} Neuron device(s), torch_neuronx, neuronx-cc at {self.compiler}"
        missing = []
        if not self.devices:
            missing.append("no /dev/neuron* device")
        elif self.torch_neuronx_error:
            missing.append(self.torch_neuronx_error)
        if self.compiler is None:
            missing.append("neuronx-cc compiler not on PATH")
        return "; ".join(missing)
