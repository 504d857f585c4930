"""Google TPU backend (torch_xla, static shape buckets, Pallas ragged paged attention): registered, probed,
not implemented yet."""
from __future__ import annotations

import importlib.util

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import PendingBackend


class TpuBackend(PendingBackend):
    name = "tpu"
    priority = 70
    planned_attention_impl = "Pallas ragged paged attention via torch_xla (planned)"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            if importlib.util.find_spec("torch_xla") is None:
                return ProbeResult(False, "torch_xla not installed")
        except Exception as error:
            return ProbeResult(False, f"torch_xla not importable: {error}")
        return ProbeResult(False, "torch_xla is installed, but the TPU backend "
                                  "arrives with its own issue")
