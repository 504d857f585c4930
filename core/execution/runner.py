"""Flattens one step into a ragged token batch, runs the model, returns logits."""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..backend_contract import AttentionMetadata, BackendInterface, LoraBatch
from ..lora.batch import BASE, lora_batch, slice_batch
from ..multimodal.encoder_cache import EncoderCache
from ..multimodal.image_rows import image_rows, row_seq_lens, window_anchors_wanted
from ..multimodal.positions import grid_positions, shifted
from ..multimodal.splice import spliced_embeddings
from ..scheduling.output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepInput:
    input_ids: torch.Tensor  # [T] int64, every scheduled token, request after request
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [R] int64: the last token of each request that samples; of a request verifying k proposed
    # tokens (core/spec), its last k + 1 tokens, in order (ScheduledRequest.num_logits rows)
    logits_indices: torch.Tensor
    sampling_request_ids: tuple[str, ...]  # the S requests that sample, in the order of their rows
    # (request id, first flat token index, count) of positions whose logits score prompt tokens
    prompt_logits_spans: tuple[tuple[str, int, int], ...] = ()
    # (request id, first flat token index, count) of every token of each pooling request (core/pooling)
    pooling_spans: tuple[tuple[str, int, int], ...] = ()
    # LoRA (core/lora): the adapter slot of every token, and of every logits_indices row; None: no
    # token of the step has an adapter
    lora: LoraBatch | None = None
    lora_logits: LoraBatch | None = None


def decodes_by_row(s: ScheduledRequest) -> bool:
    """Whether a request's query tokens are attended as decode rows, one query token each: a
    decode, and a decode verifying proposed tokens (core/spec). Each of a verify's k + 1 rows
    attends to the cache up to its own position (every row's keys and values are written
    before any row attends), so it gets the logits the plain decode of its token would: the
    kernels of a decode do not depend on the rows beside it, and greedy speculation gives the
    tokens of greedy decoding exactly."""
    return len(s.token_ids) == 1 + s.num_draft_tokens


def attends_by_row(s: ScheduledRequest, bidirectional_images: bool = False) -> bool:
    """Whether a request's query tokens are decode rows without `by_row`: a decode (decodes_by_row),
    and, for a model whose image tokens attend to each other both ways, a chunk with image tokens
    (core/multimodal/image_rows.py)."""
    return decodes_by_row(s) or (bidirectional_images and image_rows(s))


def order_for_attention(scheduled: tuple[ScheduledRequest, ...], by_row: bool = False,
                        bidirectional_images: bool = False) -> list[ScheduledRequest]:
    """Decode rows first, as AttentionMetadata promises the kernels."""
    if by_row:
        return list(scheduled)
    decodes = [s for s in scheduled if attends_by_row(s, bidirectional_images)]
    if len(decodes) == len(scheduled):
        return list(scheduled)
    return decodes + [s for s in scheduled if not attends_by_row(s, bidirectional_images)]


def build_step_input(scheduler_output: SchedulerOutput, block_size: int, device: torch.device,
                     by_row: bool = False, lora_slots: Mapping[str, int] | None = None,
                     bidirectional_images: bool = False, window_anchors: bool = False) -> StepInput:
    """The host-side lists are built in plain Python and each becomes one tensor: a step
    holds few tokens, and small torch ops cost more than the lists (repeat_interleave and
    advanced indexing also start OpenMP regions, which stall for milliseconds on a busy
    machine). `by_row`: every query token is a decode row, a prompt chunk's too (each
    attends to the cache up to its own position, written before any row attends), so the
    attention of a token does not depend on how its prompt was cut into chunks, on a cached
    prefix, or on the rows beside it (batch invariance, where the runner asks for it). `lora_slots`:
    the slot of each adapter of the step (core/lora/manager.py activate), when LoRA is on.
    `bidirectional_images`: a chunk with image tokens is decode rows, an image token's attending
    up to its image's last token (core/multimodal/image_rows.py; CausalLM.bidirectional_images).
    `window_anchors` (the backend honours them, image_rows.window_anchors_wanted): a step with such
    image rows gives every request its window anchor, a row its own position, a prompt chunk its
    last (AttentionMetadata.window_anchors); any other step carries none."""
    ordered = order_for_attention(scheduler_output.scheduled, by_row, bidirectional_images)
    anchored = window_anchors and bidirectional_images and any(s.images for s in ordered)
    anchors: list[int] = []
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampling_ids: list[str] = []
    prompt_spans: list[tuple[str, int, int]] = []
    pooling_spans: list[tuple[str, int, int]] = []
    num_decodes = 0
    rows: list[ScheduledRequest] = []  # the request of each attention row
    for s in ordered:
        n, start, first = len(s.token_ids), s.num_computed_tokens, query_start_loc[-1]
        input_ids.extend(s.token_ids)
        # images whose grids shift the positions after them (core/multimodal/positions.py)
        positions.extend(shifted(s.images, start, n, s.position_shift) if s.images or s.position_shift
                         else range(start, start + n))
        slot_mapping.extend(_slots(s.block_ids, start, start + n, block_size))
        if by_row or attends_by_row(s, bidirectional_images):  # n rows of one query token
            num_decodes += n
            query_start_loc.extend(range(query_start_loc[-1] + 1, query_start_loc[-1] + n + 1))
            seq_lens.extend(row_seq_lens(s) if bidirectional_images and s.images else range(start + 1, start + n + 1))
            rows.extend([s] * n)
            if anchored:
                anchors.extend(range(start, start + n))
        else:
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            rows.append(s)
            if anchored:
                anchors.append(start + n - 1)
        if s.samples:
            logits_indices.extend(range(first + n - s.num_logits, first + n))
            sampling_ids.append(s.request_id)
        if s.computes_prompt_logprobs:
            # position j scores token j + 1; the last position of a final chunk scores an output
            count = n - 1 if s.samples else n
            if count > 0:
                prompt_spans.append((s.request_id, first, count))
        if s.pools:
            pooling_spans.append((s.request_id, first, n))
    max_blocks = max(-(-length // block_size) for length in seq_lens)
    table = [list(s.block_ids[:max_blocks]) + [0] * (max_blocks - min(len(s.block_ids), max_blocks))
             for s in rows]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        num_decodes=num_decodes, max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(query_start_loc), seq_lens_cpu=tuple(seq_lens),
        window_anchors=torch.tensor(anchors, dtype=torch.int32, device=device) if anchored else None,
        window_anchors_cpu=tuple(anchors) if anchored else None)
    lora = lora_logits = None
    if lora_slots is not None:
        lora, lora_logits = _lora_batches(ordered, lora_slots, logits_indices, device)
    return StepInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device), meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sampling_request_ids=tuple(sampling_ids), prompt_logits_spans=tuple(prompt_spans),
        pooling_spans=tuple(pooling_spans), lora=lora, lora_logits=lora_logits)


def _lora_batches(ordered: list[ScheduledRequest], lora_slots: Mapping[str, int], logits_indices: list[int],
                  device: torch.device) -> tuple[LoraBatch | None, LoraBatch | None]:
    """The LoraBatch of the step's tokens (laid out as `ordered`) and of its logits rows."""
    token_slots = [BASE if s.lora_name is None else lora_slots[s.lora_name]
                   for s in ordered for _ in range(len(s.token_ids))]
    return lora_batch(token_slots, device), lora_batch([token_slots[i] for i in logits_indices], device)


def _slots(block_ids: tuple[int, ...], start: int, stop: int, block_size: int) -> list[int]:
    """The KV cache slot of each position in [start, stop)."""
    if stop - start == 1:
        return [block_ids[start // block_size] * block_size + start % block_size]
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]


class ModelRunner:
    """Owns the model and its paged KV cache on the backend's device. `by_row`: every step is
    laid out as decode rows (build_step_input), for backends whose kernels then compute each
    token's logits whatever else shares its step."""

    by_row = False

    def __init__(self, model: torch.nn.Module, backend: BackendInterface, kv_caches: list[torch.Tensor],
                 block_size: int):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        # request id -> float32 logits [n, vocab] of the positions that scored prompt
        # tokens in the last step (see ScheduledRequest.computes_prompt_logprobs)
        self.last_prompt_logits: dict[str, torch.Tensor] = {}
        # request id -> final hidden states [n, hidden] of a pooling request's tokens in the last
        # step (ScheduledRequest.pools), which the engine's pooler reduces (core/pooling/pooler.py)
        self.last_pooling_hidden: dict[str, torch.Tensor] = {}
        # LoRA adapters (core/lora/manager.py), set by the loader where they are on; None: off
        self.lora = None
        self.encoder_cache = EncoderCache()  # image embeddings by content hash (core/multimodal)
        self.bidirectional_images = model.bidirectional_images  # its image tokens attend both ways (image_rows.py)
        # their rows' sliding windows counted from their own positions (AttentionMetadata.window_anchors)
        self.window_anchors = window_anchors_wanted(model, backend)

    @torch.inference_mode()
    def copy_kv(self, copies) -> None:
        """Partial prefix hits (core/kv KVCopy): each copy's first slots of its source block into
        its target block, in every layer; before the step computes, on every shard. A cache is
        [2, num_blocks, block_size, ...] (AttentionSpec.cache_shape) on every backend. (A runner
        whose execute runs outside inference mode overrides this to do the same: copy_slots.)"""
        self.copy_slots(copies)

    def copy_slots(self, copies) -> None:
        for copy in copies:
            for cache in self.kv_caches:
                cache[:, copy.target, :copy.num_slots] = cache[:, copy.source, :copy.num_slots]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, tuple[str, ...]]:
        """Returns float32 logits [R, vocab] of the requests that sample (ScheduledRequest.num_logits
        rows each: one, or k + 1 for a request verifying k proposals), and their ids."""
        step = build_step_input(scheduler_output, self.block_size, self.backend.device, self.by_row,
                                self._lora_slots(scheduler_output), self.bidirectional_images,
                                self.window_anchors)
        with self._lora_rows(step.lora):
            hidden = (self.forward_images(scheduler_output, step) if _has_images(scheduler_output)
                      else self.forward(step))
        self.last_prompt_logits = {rid: self._logits(hidden[start:start + count], slice_batch(step.lora, start, count))
                                   for rid, start, count in step.prompt_logits_spans}
        self.last_pooling_hidden = {rid: hidden[start:start + count] for rid, start, count in step.pooling_spans}
        if not step.sampling_request_ids:
            return hidden.new_empty((0, 0), dtype=torch.float32), ()
        logits = self._logits(hidden[step.logits_indices], step.lora_logits)
        return logits, step.sampling_request_ids

    def _lora_slots(self, scheduler_output: SchedulerOutput) -> dict[str, int] | None:
        """LoRA (core/lora): the slot of each adapter of the step, made resident now; None when the
        step has none (or LoRA is off)."""
        names = [] if self.lora is None else [s.lora_name for s in scheduler_output.scheduled if s.lora_name]
        return self.lora.activate(names) if names else None

    def _lora_rows(self, batch: LoraBatch | None):
        """The adapters of the rows a block computes, for the model's wrapped layers (core/lora/context.py)."""
        return nullcontext() if self.lora is None else self.lora.context.rows(batch)

    def _logits(self, hidden: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """compute_logits of these rows, each with its adapter's output head where one targets it."""
        with self._lora_rows(lora):
            return self.model.compute_logits(hidden)

    def forward_images(self, scheduler_output: SchedulerOutput, step: StepInput) -> torch.Tensor:
        """A step that computes image tokens: always the model's own forward, given the step's
        input embeddings with the images' written in (core/multimodal/splice.py)."""
        ordered = order_for_attention(scheduler_output.scheduled, self.by_row, self.bidirectional_images)
        embeds = spliced_embeddings(self.model, step.input_ids, ordered, self.encoder_cache)
        positions = step.positions
        if self.model.grid_positions:  # M-RoPE: the image tokens' 3D positions [3, T]
            positions = torch.tensor(grid_positions(ordered, positions.tolist()), device=positions.device)
        return self.model(step.input_ids, positions, self.kv_caches, step.meta, inputs_embeds=embeds)

    def forward(self, step: StepInput) -> torch.Tensor:
        """The final hidden states of every token of the step [T, hidden]."""
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)


def _has_images(scheduler_output: SchedulerOutput) -> bool:
    return any(s.images for s in scheduler_output.scheduled)


def runner_for(backend, loaded, kv_caches: list[torch.Tensor], config) -> ModelRunner:
    """The runner of a loaded model's steps: the backend's own (Backend.make_runner), or the plain
    ModelRunner where it returns None (the default)."""
    return backend.make_runner(loaded, kv_caches, config) or ModelRunner(loaded.model, backend, kv_caches,
                                                                         config.cache.block_size)
