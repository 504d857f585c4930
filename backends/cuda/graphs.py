"""CUDA graphs for decode-only steps.

At warm-up one graph is captured per batch-size bucket (1, 2, 4, 8, 16, 24, ... up to
max_num_seqs), largest first, all sharing one memory pool. Each graph runs the model
and the LM head over static buffers and writes float32 logits into one static
[max_bucket, vocab] buffer. A decode-only step of B requests is staged into pinned
host buffers, copied to the static device buffers (three copies), padded to the
smallest bucket >= B and replayed. Padding rows write no KV (slot -1), attend to one
key of the reserved block 0 and their logits are never read. Steps with a prompt
chunk, or more requests than the largest bucket, run eagerly (ModelRunner.execute).

Graph capture freezes whatever the attention kernel reads from the metadata's host
fields, so only kernels that declare `graph_safe = True` (AttentionKernel.graph_safe: they
read the device tensors and shapes alone on decode-only batches) are captured; the
capture-time metadata holds worst-case host values (max_seq_len = max_model_len). A
quantized linear that syncs with the host (CudaQuantLinear.graph_safe False: bitsandbytes'
LLM.int8) turns graphs off too.
"""
from __future__ import annotations

import logging

import torch

from switchyard.core.backend import Backend
from switchyard.core.execution.decode_batch import BucketedDecodeRunner, DecodeBuffers, capture_sizes
from switchyard.core.layers import PagedAttention

from .quant_linear import CudaQuantLinear

logger = logging.getLogger(__name__)


def graph_unsafe_kernels(model: torch.nn.Module) -> list[str]:
    """Names of the model's kernels that cannot be captured: attention kernels, and quantized
    linears (quant_linear.py) that sync with the host."""
    names = {type(m.kernel).__name__ for m in model.modules()
             if isinstance(m, PagedAttention) and not m.kernel.graph_safe}
    names |= {type(m).__name__ for m in model.modules() if isinstance(m, CudaQuantLinear) and not m.graph_safe}
    return sorted(names)


class CudaGraphRunner(BucketedDecodeRunner):
    """ModelRunner that replays captured graphs for decode-only steps (see the module docstring).

    `device_ops` holds the device calls (backends/cuda/device.py); tests pass a fake."""

    def __init__(self, model: torch.nn.Module, backend: Backend, kv_caches: list[torch.Tensor], block_size: int,
                 *, max_num_seqs: int, max_model_len: int, vocab_size: int, device_ops, enabled: bool = True,
                 sizes: tuple[int, ...] | None = None):
        super().__init__(model, backend, kv_caches, block_size)
        self.device_ops = device_ops
        self.max_model_len = max_model_len
        self.sizes: tuple[int, ...] = ()
        self.graphs: dict[int, object] = {}
        self.num_replays = 0
        unsafe = graph_unsafe_kernels(model)
        chosen = capture_sizes(max_num_seqs) if sizes is None else \
            tuple(sorted({s for s in sizes if 0 < s <= max(1, max_num_seqs)}))
        self.disabled_reason = ("disabled by configuration" if not enabled or not chosen else
                                f"kernel(s) {', '.join(unsafe)} not graph-safe" if unsafe else None)
        if self.disabled_reason is None:
            self.sizes = chosen
            max_blocks = -(-max_model_len // block_size)
            with torch.inference_mode():
                self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, block_size, backend.device,
                                             device_ops.pin_memory)
                self.logits = torch.empty((self.sizes[-1], vocab_size), dtype=torch.float32, device=backend.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures one graph per bucket, largest first (smaller ones reuse its pool)."""
        if self.disabled_reason is not None:
            logger.info("CUDA graphs off: %s", self.disabled_reason)
            return
        pool = self.device_ops.graph_pool()
        self.buffers.pad_all()
        for batch in reversed(self.sizes):
            run = self._decode_fn(batch)
            self.device_ops.warm_up(run)  # compiles kernels, sets up library handles: not captured
            self.graphs[batch] = self.device_ops.capture(run, pool)
        self.device_ops.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", ", ".join(map(str, self.sizes)))

    def _decode_fn(self, batch: int):
        meta = self.buffers.meta(batch, self.max_model_len)
        input_ids, positions = self.buffers.tokens[0, :batch], self.buffers.tokens[1, :batch]
        logits = self.logits[:batch]
        model, kv_caches = self.model, self.kv_caches

        def run() -> None:
            hidden = model(input_ids, positions, kv_caches, meta)
            logits.copy_(model.compute_logits(hidden))

        return run

    def ready_sizes(self) -> tuple[int, ...]:
        return self.sizes if self.graphs else ()

    def run_bucket(self, batch: int) -> torch.Tensor:
        self.graphs[batch].replay()
        self.num_replays += 1
        return self.logits
