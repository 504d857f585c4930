"""AWS Neuron backend (optimum-neuron compiled model, static buckets): registered, probed, not implemented yet."""
from __future__ import annotations

import glob
import importlib.util

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import PendingBackend


class NeuronBackend(PendingBackend):
    name = "neuron"
    priority = 60
    planned_attention_impl = "optimum-neuron compiled model with static buckets (planned)"

    @classmethod
    def probe(cls) -> ProbeResult:
        missing = []
        try:
            if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.neuron") is None:
                missing.append("optimum-neuron not installed")
        except Exception as error:  # find_spec imports the parent package, which may fail
            missing.append(f"optimum-neuron not importable: {error}")
        if not glob.glob("/dev/neuron*"):
            missing.append("no /dev/neuron* device")
        if missing:
            return ProbeResult(False, "; ".join(missing))
        return ProbeResult(False, "a Neuron device is present, but the Neuron backend "
                                  "arrives with its own issue")
