"""A request as the engine core sees it: token ids, progress, blocks, outputs."""
from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

from ..multimodal.inputs import ImageData, ImageSpan, block_extra_key
from ..params import SamplingParams
from ..pooling.params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """How a sequence ended, in the engine's own words; each dialect's renderer maps
    it to its wire word (OpenAI: stop/length/..., TGI: eos_token/length/stop_sequence)."""

    LENGTH = "length"  # max_tokens or the context length
    EOS = "eos"
    STOP_TOKEN = "stop_token"  # one of stop_token_ids
    STOP_STRING = "stop_string"
    ABORT = "abort"
    GRAMMAR = "grammar"  # the constraining grammar is complete: nothing more may follow
    POOLED = "pooled"  # a pooling request's prompt is computed and pooled into its embedding (core/pooling)

    def __str__(self) -> str:
        return self.value


# When several reasons hold at the same token, the first of these names the finish: the
# model's own end (EOS, a stop token) over a complete grammar, over a stop string, over
# running out of length. ABORT is never decided here: it is imposed from outside.
_PRECEDENCE = (FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.GRAMMAR, FinishReason.STOP_STRING,
               FinishReason.LENGTH)


def decide_finish(*reasons: FinishReason | None) -> FinishReason | None:
    """The one rule for a sequence's finish reason: of the reasons found so far (by the
    scheduler's token checks, the grammar, the stop strings of the detokenized text; None
    where a check found nothing), the one of highest precedence; None if none holds."""
    held = {r for r in reasons if r is not None}
    if FinishReason.ABORT in held:
        return FinishReason.ABORT
    return next((r for r in _PRECEDENCE if r in held), None)


# A pooling request's embedding: float32 values (array('f'): compact to pickle across the engine's
# pipe; the gateway writes floats or base64 of its little-endian bytes from it).
EmbeddingVector = array


def pooling_request(request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> Request:
    """A pooling (embedding) request: its sampling parameters are a placeholder nothing reads."""
    return Request(request_id, list(prompt_token_ids), _NO_SAMPLING, pooling=params)


_SEED_MASK = (1 << 63) - 1


def sequence_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th of the n sequences a seeded request asks for. The
    first keeps the request's seed (n=1 is unchanged); the others are mixed
    (splitmix64 of seed and index), so that seed 1 with n=3 shares no sequence seed
    with seed 2 (seed + i did)."""
    if index == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first admitted to the batch
    # Prefix caching (core/kv): requests share KV blocks only with an equal salt (per adapter or
    # tenant); requests of one share group (the n / best_of sequences of one prompt) share their
    # live prompt blocks even when prefix caching is off.
    cache_salt: str | None = None
    share_group: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order (kept on preemption)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # W3C trace context of the gateway's request span ({"traceparent": ..., "tracestate": ...}) when
    # tracing is on: the engine's queue/prefill/decode spans are its children (core/tracing.py)
    trace_context: dict[str, str] | None = None
    # A pooling request (core/pooling): its prompt is computed, pooled into one embedding and it
    # ends; it samples nothing (its sampling_params are not read). None: a generation request.
    pooling: PoolingParams | None = None
    # The LoRA adapter it runs with (core/lora), by the name it was loaded under; None: the base model
    lora_name: str | None = None
    # Images (core/multimodal): as the gateway sent them, one per image placeholder token of the
    # prompt; the engine expands each placeholder at add_request and records where it sits
    images: tuple[ImageData, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def block_extra_key(self, start: int, stop: int) -> bytes:
        """What the prefix-cache hash of positions [start, stop) mixes in: the images there."""
        return block_extra_key(self.image_spans, start, stop)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without concatenating the whole list."""
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        num_prompt = len(prompt)
        if start >= num_prompt:
            return outputs[start - num_prompt:stop - num_prompt]
        if stop <= num_prompt:
            return prompt[start:stop]
        return prompt[start:] + outputs[:stop - num_prompt]

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt + all outputs)."""
        max_tokens = self.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else self.num_prompt_tokens + max_tokens
        return min(limit, self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """core -> gateway: what one request produced in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[float, ...] | None = None  # of each new token
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    first_scheduled_time: float | None = None  # time.monotonic(); set on the finished output
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # on the first output, when SamplingParams.prompt_logprobs is set: one entry per prompt
    # token, (token id, logprob (None for the first token), top-n ((id, logprob), ...))
    prompt_logprobs: tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...] | None = None
    # set when the request failed after it was queued (e.g. its grammar did not compile);
    # the client raises it instead of handing out this output
    error: BaseException | None = None
    embedding: EmbeddingVector | None = None  # a pooling request's, on its one (finished) output

    @property
    def stop_reason(self) -> int | None:
        """The stop token id that ended the request, if one did."""
        if self.finish_reason is FinishReason.STOP_TOKEN and self.new_token_ids:
            return self.new_token_ids[-1]
        return None


@dataclass(frozen=True)
class EngineCoreOutput:
    """What the engine core produced for one request in one step (token level)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    # of each new token (several in a step that accepted speculative tokens), when asked for
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # with the first token, when asked for: (token id, logprob or None for the first, top-n)
    prompt_logprobs: tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...] | None = None
    error: BaseException | None = None  # the request failed (finish_reason ABORT, no tokens)
    embedding: EmbeddingVector | None = None  # a pooling request's (finish_reason POOLED, no tokens)


_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
