"""The static-shape runner of XLA devices (TPU, and Neuron through torch-neuronx).

Each step is built on the host as the plain runner builds it, then padded to its shape
bucket (buckets.py): extra tokens carry token 0, position 0 and slot 0 (reserved block 0,
which no request reads); extra requests have no tokens and length 0; the block table always
has the bucket's max_blocks columns; the logits rows are padded to the request bucket. The
padded step is moved to the device in one go, the model and lm_head run as one lazy graph,
and only the real logits rows come back. warm_up() compiles every bucket once, before the
first request, so serving never compiles.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from switchyard.core.backend import AttentionMetadata, Backend
from switchyard.core.execution.runner import ModelRunner, StepInput, build_step_input
from switchyard.core.scheduling.output import SchedulerOutput

from .buckets import ShapeBuckets

logger = logging.getLogger(__name__)


def _pad(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    return torch.cat([values, values.new_full((length - values.shape[0],), fill)])


def pad_step(step: StepInput, buckets: ShapeBuckets) -> tuple[StepInput, int]:
    """The (host) step padded to its bucket, and its number of real logits rows."""
    meta = step.meta
    tokens = buckets.pad_tokens(step.input_ids.shape[0])
    requests = buckets.pad_requests(meta.num_requests)
    table = torch.zeros(requests, buckets.max_blocks, dtype=torch.int32)
    table[:meta.num_requests, :meta.block_table.shape[1]] = meta.block_table
    padded = replace(meta, query_start_loc=_pad(meta.query_start_loc, requests + 1, meta.query_start_loc_cpu[-1]),
                     seq_lens=_pad(meta.seq_lens, requests, 0), block_table=table,
                     slot_mapping=_pad(meta.slot_mapping, tokens, 0),
                     max_query_len=tokens, max_seq_len=meta.max_seq_len)
    return replace(step, input_ids=_pad(step.input_ids, tokens, 0), positions=_pad(step.positions, tokens, 0),
                   meta=padded, logits_indices=_pad(step.logits_indices, requests, 0)), step.logits_indices.shape[0]


def empty_step(tokens: int, requests: int, max_blocks: int) -> StepInput:
    """An all-padding host step of one bucket shape: no request has a token; every write
    goes to slot 0 (reserved block 0)."""
    meta = AttentionMetadata(
        query_start_loc=torch.zeros(requests + 1, dtype=torch.int32), seq_lens=torch.zeros(requests, dtype=torch.int32),
        block_table=torch.zeros(requests, max_blocks, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), num_decodes=0, max_query_len=tokens, max_seq_len=0,
        query_start_loc_cpu=(0,) * (requests + 1), seq_lens_cpu=(0,) * requests)
    zeros = torch.zeros(tokens, dtype=torch.int64)
    return StepInput(input_ids=zeros, positions=zeros.clone(), meta=meta,
                     logits_indices=torch.zeros(requests, dtype=torch.int64), sampling_request_ids=())


def to_device(step: StepInput, device: torch.device) -> StepInput:
    """Every tensor of the step moved as data (so the graph is the same for every step of a shape)."""
    meta = step.meta
    meta = replace(meta, query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
                   block_table=meta.block_table.to(device), slot_mapping=meta.slot_mapping.to(device))
    return replace(step, input_ids=step.input_ids.to(device), positions=step.positions.to(device), meta=meta,
                   logits_indices=step.logits_indices.to(device))


class StaticShapeRunner(ModelRunner):
    """ModelRunner whose every step has one of buckets.shapes(); `sync` ends a lazy step
    (torch_xla.sync on XLA; the backend passes it so this file imports no vendor code)."""

    def __init__(self, model: torch.nn.Module, backend: Backend, kv_caches: list[torch.Tensor], block_size: int,
                 buckets: ShapeBuckets, sync: Callable[[], None]):
        super().__init__(model, backend, kv_caches, block_size)
        self.buckets = buckets
        self.sync = sync
        self.warm_up_seconds = 0.0

    @torch.no_grad()  # torch_xla refuses inference tensors
    def copy_kv(self, copies) -> None:
        self.copy_slots(copies)

    @torch.no_grad()  # torch_xla refuses inference tensors
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, tuple[str, ...]]:
        host = build_step_input(scheduler_output, self.block_size, torch.device("cpu"))
        step, num_logits = pad_step(host, self.buckets)
        logits, all_logits = self._run(step)
        self.last_prompt_logits = {rid: all_logits[start:start + count]
                                   for rid, start, count in step.prompt_logits_spans}
        if not step.sampling_request_ids:
            return torch.empty((0, 0), dtype=torch.float32), ()
        return logits[:num_logits], step.sampling_request_ids

    def _run(self, host_step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One padded step as one graph: (logits of every request row, on the host; and the
        logits of every token when the step scores prompt tokens: one more graph per token
        bucket, compiled on first use, as prompt logprobs are rare)."""
        step = to_device(host_step, self.backend.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        all_logits = self.model.compute_logits(hidden) if step.prompt_logits_spans else None
        self.sync()
        return logits.cpu(), None if all_logits is None else all_logits.cpu()

    @torch.no_grad()  # torch_xla refuses inference tensors
    def warm_up(self) -> int:
        """Runs one all-padding step of every bucket shape (its writes land in reserved
        block 0); returns how many shapes were run. Sets warm_up_seconds."""
        began = time.perf_counter()
        shapes = self.buckets.shapes()
        for tokens, requests in shapes:
            self._run(empty_step(tokens, requests, self.buckets.max_blocks))
        self.warm_up_seconds = time.perf_counter() - began
        logger.info("compiled %d shape buckets in %.1f s", len(shapes), self.warm_up_seconds)
        return len(shapes)
