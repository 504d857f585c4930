"""Google TPU backend: torch_xla (PJRT), static shape buckets compiled at warm-up, Pallas
ragged paged attention on a TPU and XLA gather attention elsewhere (PJRT_DEVICE=CPU)."""
from .backend import TpuBackend

__all__ = ["TpuBackend"]
