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
capture-time metadata holds worst-case host values (max_seq_len = max_model_len).
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from switchyard.core.backend import AttentionMetadata, Backend
from switchyard.core.layers import PagedAttention
from switchyard.core.runner import ModelRunner
from switchyard.core.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """Batch-size buckets: 1, 2, 4, then every multiple of 8, then max_num_seqs itself."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def bucket_for(num_requests: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds num_requests rows, or None when none does."""
    index = bisect.bisect_left(sizes, num_requests)
    return sizes[index] if index < len(sizes) else None


def graph_unsafe_kernels(model: torch.nn.Module) -> list[str]:
    """Names of the attention kernels of the model that cannot be captured."""
    names = {type(m.kernel).__name__ for m in model.modules()
             if isinstance(m, PagedAttention) and not m.kernel.graph_safe}
    return sorted(names)


class DecodeBuffers:
    """Static device inputs of the decode graphs and the pinned host buffers staged into them."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device, pin: bool):
        self.max_batch, self.block_size = max_batch, block_size
        self.tokens = torch.zeros((3, max_batch), dtype=torch.int64, device=device)  # ids, positions, slots
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._host_tokens = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._host_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._tokens_np, self._seq_lens_np = self._host_tokens.numpy(), self._host_seq_lens.numpy()
        self._table_np = self._host_table.numpy()
        self._rows: list[tuple[int, ...] | None] = [None] * max_batch  # block ids last staged per row
        self.pad_all()

    def pad_all(self) -> None:
        """Every row a padding row (used for warm-up and capture: nothing is written to the KV cache)."""
        self._stage_padding(0, self.max_batch)
        self._copy(self.max_batch)

    def meta(self, batch: int, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch], slot_mapping=self.tokens[2, :batch], num_decodes=batch,
            max_query_len=1, max_seq_len=max_model_len, query_start_loc_cpu=tuple(range(batch + 1)),
            seq_lens_cpu=(max_model_len,) * batch)

    def stage(self, scheduled: tuple[ScheduledRequest, ...], batch: int) -> None:
        """Writes one decode-only step (len(scheduled) <= batch rows, the rest padding) to the device."""
        num, block_size = len(scheduled), self.block_size
        positions = [s.num_computed_tokens for s in scheduled]
        blocks = [s.block_ids[p // block_size] for s, p in zip(scheduled, positions)]
        tokens = self._tokens_np
        tokens[0, :num] = [s.token_ids[0] for s in scheduled]
        tokens[1, :num] = positions
        tokens[2, :num] = np.multiply(blocks, block_size) + np.remainder(positions, block_size)
        self._seq_lens_np[:num] = np.add(positions, 1)
        rows, table = self._rows, self._table_np
        for i, s in enumerate(scheduled):
            if rows[i] != s.block_ids:  # a row keeps its blocks between steps unless it changes hands or grows
                table[i, :len(s.block_ids)] = s.block_ids
                rows[i] = s.block_ids
        self._stage_padding(num, batch)
        self._copy(batch)

    def _stage_padding(self, start: int, end: int) -> None:
        self._tokens_np[:2, start:end] = 0
        self._tokens_np[2, start:end] = -1  # no KV write
        self._seq_lens_np[start:end] = 1  # one key, in the reserved block 0
        self._table_np[start:end, 0] = 0
        self._rows[start:end] = [None] * (end - start)

    def _copy(self, batch: int) -> None:
        self.tokens.copy_(self._host_tokens, non_blocking=True)
        self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self.block_table[:batch].copy_(self._host_table[:batch], non_blocking=True)


class CudaGraphRunner(ModelRunner):
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
                                f"attention kernel(s) {', '.join(unsafe)} not graph-safe" if unsafe else None)
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

    def graph_batch_size(self, scheduler_output: SchedulerOutput) -> int | None:
        """The bucket a step replays, or None when it runs eagerly."""
        scheduled = scheduler_output.scheduled
        if not self.graphs or not scheduled or any(len(s.token_ids) != 1 or s.computes_prompt_logprobs
                                                   for s in scheduled):
            return None  # graphs return last-token logits only
        return bucket_for(len(scheduled), self.sizes)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, tuple[str, ...]]:
        batch = self.graph_batch_size(scheduler_output)
        if batch is None:
            return super().execute(scheduler_output)
        scheduled = scheduler_output.scheduled
        self.buffers.stage(scheduled, batch)
        self.graphs[batch].replay()
        self.num_replays += 1
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        request_ids = tuple(scheduled[i].request_id for i in rows)
        if len(rows) == len(scheduled):
            return self.logits[:len(rows)], request_ids
        index = torch.tensor(rows, dtype=torch.long).to(self.logits.device, non_blocking=True)
        return self.logits.index_select(0, index), request_ids
