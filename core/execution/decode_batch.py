"""Decode-only steps over static buffers, padded to a batch-size bucket.

Graph runners (CUDA graphs, backends/cuda/graphs.py; compiled CPU graphs,
backends/cpu/compiled.py) run a decode-only step of B requests as one prepared graph
for the smallest bucket >= B. `DecodeBuffers` holds that graph's inputs: the step is
staged into host buffers and copied to the static device buffers; rows past B are
padding that writes no KV (slot -1), attends to one key of the reserved block 0, and
whose logits are never read.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from ..backend_contract import AttentionMetadata
from .runner import ModelRunner, decodes_by_row
from ..scheduling.output import ScheduledRequest, SchedulerOutput

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
        tokens[1, :num] = [p + s.position_shift for s, p in zip(scheduled, positions)]  # images' M-RoPE shift
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


def decode_only(scheduler_output: SchedulerOutput) -> bool:
    """Whether a graph can run this step: every request one new token, none scores its prompt,
    none pools (graphs return the logits of the last token of each row only) and none is an image's
    token (its input embedding is the image's row: ModelRunner.forward_images)."""
    scheduled = scheduler_output.scheduled
    return bool(scheduled) and not any(len(s.token_ids) != 1 or s.computes_prompt_logprobs or s.pools or s.images
                                       for s in scheduled)


def decode_rows_only(scheduler_output: SchedulerOutput) -> bool:
    """Whether every request of the step is attended as decode rows (core/execution/runner.py
    decodes_by_row: a decode, or a decode verifying proposed tokens) and none scores its
    prompt: a kernel that runs a batch of one-token decodes runs the step."""
    return bool(scheduler_output.scheduled) and all(decodes_by_row(s) and not s.computes_prompt_logprobs
                                                    and not s.pools for s in scheduler_output.scheduled)


def _uses_adapters(scheduler_output: SchedulerOutput) -> bool:
    """A step with LoRA adapter rows (core/lora) runs eagerly: the graphs hold the base model only."""
    return any(s.lora_name is not None for s in scheduler_output.scheduled)


def sampling_rows(scheduled: tuple[ScheduledRequest, ...], logits: torch.Tensor) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The rows of a padded step's logits [bucket, vocab] that sample, and their request ids
    (ModelRunner.execute's result)."""
    rows = [i for i, s in enumerate(scheduled) if s.samples]
    request_ids = tuple(scheduled[i].request_id for i in rows)
    if len(rows) == len(scheduled):
        return logits[:len(rows)], request_ids
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    return logits.index_select(0, index), request_ids


class BucketedDecodeRunner(ModelRunner):
    """A ModelRunner whose decode-only steps run a prepared graph of a bucket (the smallest of
    `ready_sizes()` that holds them), staged through `self.buffers`; every other step, and
    every step while no graph is ready, runs the eager ModelRunner.execute. Subclasses
    prepare the graphs and say how one runs (`run_bucket`)."""

    buffers: DecodeBuffers

    def ready_sizes(self) -> tuple[int, ...]:
        """The buckets with a graph ready to run, ascending."""
        raise NotImplementedError

    def run_bucket(self, batch: int) -> torch.Tensor:
        """Runs the graph of bucket `batch` on the staged buffers: float32 logits [>= batch, vocab]."""
        raise NotImplementedError

    def graph_batch_size(self, scheduler_output: SchedulerOutput) -> int | None:
        """The bucket a step runs in, or None when it runs eagerly."""
        sizes = self.ready_sizes()
        if not sizes or not decode_only(scheduler_output) or _uses_adapters(scheduler_output):
            return None
        return bucket_for(len(scheduler_output.scheduled), sizes)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, tuple[str, ...]]:
        batch = self.graph_batch_size(scheduler_output)
        if batch is None:
            return super().execute(scheduler_output)
        scheduled = scheduler_output.scheduled
        self.buffers.stage(scheduled, batch)
        logits = self.run_bucket(batch)
        self.last_prompt_logits = {}  # a decode-only step scores no prompt tokens
        self.last_pooling_hidden = {}  # ... and pools none (decode_only)
        return sampling_rows(scheduled, logits)
