"""A draft model proposer (--speculative-model): a smaller model with the target's tokenizer
proposes each speculating request's next tokens greedily.

The draft is loaded by the same loader and run by the same backend as the target (its
`prepare_model` and its `ModelRunner`), unsharded, in the engine's process (shard 0), with its
own paged KV cache: its own BlockPool and KVCacheManager (prefix caching off), so it never
takes a block from the target. Each request keeps a `_DraftSequence`: the draft's blocks and how
many of the request's tokens it has computed.

One `propose` call serves a whole step: the first forward computes, for every speculating
request, the tokens the draft has not computed yet (the prompt at first, the accepted tokens
and the newest token later) and gives the first proposal from the logits at the last one; each
further forward feeds every request's latest proposal, one token each, for the next. So k
proposals cost k forwards of the draft for the whole batch. The argmax is a point mass, so the
target's acceptance rule stays exact (acceptance.py).

A sequence's computed tokens past the request's confirmed ones are proposals fed to the draft;
at the next call those the target did not keep are rolled back (the computed count is cut to
the common prefix with the request's tokens, and blocks past it are given back). A prompt
longer than the step's catch-up budget is computed over several steps, in chunks, without
proposals meanwhile; a request the draft's cache (or context) cannot hold proposes nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..backend import Backend
from ..config import EngineConfig, ParallelConfig
from ..errors import ValidationError
from ..kv import BlockPool, KVCacheManager
from ..loader import LoadedModel, choose_model, load_model, load_tokenizer
from ..scheduling.request import Request
from ..execution.runner import ModelRunner, runner_for
from ..scheduling.output import ScheduledRequest, SchedulerOutput
from .proposer import ProposalSlot

logger = logging.getLogger(__name__)


class DraftModelError(ValidationError):
    """The draft model cannot serve this target (one line: it names both and the mismatch); a
    configuration error, so `serve` exits 2 with it."""


def check_draft_model(config: EngineConfig, tokenizer=None) -> None:
    """Refuse a draft that does not share the target's tokenizer: its logits width must be the
    target's and the two tokenizers must map the same strings to the same ids. Cheap: the
    configs and tokenizers, no weights. `tokenizer`: the target's, if already loaded."""
    spec = config.speculative
    draft_config = spec.draft_model_config(config.model)
    target_vocab_size = choose_model(config.model)[1].vocab_size
    _, hf_config, _ = choose_model(draft_config)
    if hf_config.vocab_size != target_vocab_size:
        raise DraftModelError(f"--speculative-model {spec.draft_model}: its vocabulary has {hf_config.vocab_size} "
                              f"tokens, the model's {target_vocab_size}; a draft model must share the model's "
                              "tokenizer")
    target_vocab = (tokenizer or load_tokenizer(config.model)).get_vocab()
    draft_vocab = load_tokenizer(draft_config).get_vocab()
    if draft_vocab != target_vocab:
        differing = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise DraftModelError(f"--speculative-model {spec.draft_model}: its tokenizer differs from the model's "
                              f"({differing} token entries are not shared); a draft model must share the model's "
                              "tokenizer")


@dataclass
class _DraftSequence:
    """The draft's side of one request. `view` carries its blocks and computed count for the
    draft's KVCacheManager; its first `num_confirmed` computed tokens are the request's own,
    the ones after them (`fed`) proposals whose keys and values the draft wrote."""

    view: Request
    num_confirmed: int = 0
    fed: tuple[int, ...] = field(default=())

    @property
    def num_computed(self) -> int:
        return self.view.num_computed_tokens


class DraftModelProposer:
    """`catchup_budget`: the most tokens the first forward of a step computes (the scheduler's
    token budget); the draft's own `max_model_len` bounds the positions it proposes at."""

    def __init__(self, runner: ModelRunner, kv_cache_manager: KVCacheManager, max_model_len: int,
                 catchup_budget: int):
        if catchup_budget < 1:
            raise ValueError(f"the draft's catch-up budget must be positive, got {catchup_budget}")
        self.runner = runner
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.catchup_budget = catchup_budget
        self._sequences: dict[str, _DraftSequence] = {}
        self.num_without_room = 0  # requests the draft's full cache left without proposals, over its life

    @classmethod
    def load(cls, config: EngineConfig, backend: Backend, target: LoadedModel, target_num_blocks: int
             ) -> DraftModelProposer:
        """Loads the draft (checked already: check_draft_model) on `backend`, with a KV cache
        of SpeculativeConfig.draft_num_blocks blocks (default: as many as the target's)."""
        draft_config = replace(config, model=config.speculative.draft_model_config(config.model),
                               parallel=ParallelConfig())
        block_size = config.cache.block_size
        loaded = load_model(draft_config.model, backend, block_size, kv_cache_dtype=config.cache.kv_cache_dtype)
        backend.prepare_model(loaded, draft_config)
        num_blocks = config.speculative.draft_num_blocks or target_num_blocks
        kv_caches = backend.allocate_kv_cache(loaded.num_layers, num_blocks, loaded.attention_spec)
        runner = runner_for(backend, loaded, kv_caches, draft_config)
        logger.info("draft model %s: %d KV blocks of its own", config.speculative.draft_model, num_blocks)
        return cls(runner, KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching=False),
                   min(loaded.max_model_len, target.max_model_len), config.scheduler.max_num_batched_tokens)

    def propose(self, slots: Sequence[ProposalSlot]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in slots]
        sequences = [self._settled(request) for request, _ in slots]
        first_forward, drafting, chunks = self._first_forward(slots, sequences)
        if not first_forward:
            return proposals
        next_tokens = self._forward(first_forward)
        for sequence, num_computed in chunks:
            sequence.view.num_computed_tokens = sequence.num_confirmed = num_computed
        for i, _ in drafting:
            request, sequence = slots[i][0], sequences[i]
            sequence.view.num_computed_tokens = sequence.num_confirmed = request.num_tokens
            proposals[i].append(next_tokens[request.request_id])
        for position in range(1, max((wanted for _, wanted in drafting), default=0)):
            active = [i for i, wanted in drafting if wanted > position]
            next_tokens = self._forward([self._scheduled(sequences[i], [proposals[i][-1]], True) for i in active])
            for i in active:
                sequence = sequences[i]
                sequence.view.num_computed_tokens += 1
                sequence.fed += (proposals[i][-1],)
                proposals[i].append(next_tokens[slots[i][0].request_id])
        return proposals

    def _first_forward(self, slots: Sequence[ProposalSlot], sequences: list[_DraftSequence]):
        """The step's first forward, within the catch-up budget and the draft's cache: each
        request's tokens not computed yet. Returns (its scheduled requests, (slot index,
        proposals wanted) of those it gives a first proposal, (sequence, computed count after)
        of those that only catch up a chunk). The requests with the least to catch up go first,
        so one long prompt never starves the others."""
        scheduled: list[ScheduledRequest] = []
        drafting: list[tuple[int, int]] = []
        chunks: list[tuple[_DraftSequence, int]] = []
        budget = self.catchup_budget
        for i in sorted(range(len(slots)), key=lambda i: slots[i][0].num_tokens - sequences[i].num_computed):
            request, wanted = slots[i]
            sequence, start = sequences[i], sequences[i].num_computed
            wanted = min(wanted, self.max_model_len - request.num_tokens + 1)  # last position fed < max_model_len
            num_new = request.num_tokens - start
            if wanted < 1 or budget < 1:
                continue
            if not self.kv_cache_manager.can_ever_fit(request.num_tokens + wanted - 1):
                self._release(sequence)  # it never fits in the draft's cache: its blocks serve the others
                self.num_without_room += 1
            elif num_new > budget:  # a chunk of its prompt now, proposals in a later step
                if self.kv_cache_manager.allocate_slots(sequence.view, budget):
                    scheduled.append(self._scheduled(sequence, request.token_slice(start, start + budget), False))
                    chunks.append((sequence, start + budget))
                    budget = 0
                else:
                    self.num_without_room += 1
            elif self.kv_cache_manager.allocate_slots(sequence.view, num_new, num_lookahead=wanted - 1):
                budget -= num_new
                scheduled.append(self._scheduled(sequence, request.token_slice(start, request.num_tokens), True))
                drafting.append((i, wanted))
            else:
                self.num_without_room += 1  # the draft's cache is full: no proposals for this request
        return scheduled, drafting, chunks

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv_cache_manager.free(sequence.view)

    def _release(self, sequence: _DraftSequence) -> None:
        """Give back every block of the sequence: it starts over if it ever proposes again."""
        self.kv_cache_manager.free(sequence.view)
        sequence.view.num_computed_tokens = sequence.num_confirmed = 0

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def _settled(self, request: Request) -> _DraftSequence:
        """The request's draft sequence, rolled back to what still matches the request's
        tokens (and short of its last token, whose logits give the first proposal)."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            view = Request(request.request_id, [], request.sampling_params)
            sequence = self._sequences[request.request_id] = _DraftSequence(view)
        kept = request.token_slice(sequence.num_confirmed, sequence.num_confirmed + len(sequence.fed))
        num_matching = next((j for j, (a, b) in enumerate(zip(sequence.fed, kept)) if a != b),
                            min(len(sequence.fed), len(kept)))
        valid = min(sequence.num_confirmed + num_matching, sequence.num_computed, request.num_tokens - 1)
        sequence.view.num_computed_tokens = sequence.num_confirmed = valid
        sequence.fed = ()
        self.kv_cache_manager.trim(sequence.view)
        return sequence

    def _scheduled(self, sequence: _DraftSequence, token_ids: list[int], samples: bool) -> ScheduledRequest:
        return ScheduledRequest(request_id=sequence.view.request_id, token_ids=tuple(token_ids),
                                num_computed_tokens=sequence.num_computed, block_ids=tuple(sequence.view.block_ids),
                                samples=samples)

    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """One forward of the draft; the argmax at each sampling request's last position."""
        logits, request_ids = self.runner.execute(SchedulerOutput(tuple(scheduled)))
        if not request_ids:
            return {}
        return dict(zip(request_ids, torch.argmax(logits, dim=-1).tolist()))
