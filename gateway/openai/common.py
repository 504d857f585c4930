"""What the OpenAI routes share: model names, response metadata, finish reasons,
usage, and the chunk stream of chat and completions (on gateway/pipeline.py)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from switchyard.core.scheduling.request import FinishReason, RequestOutput

from ..errors import ErrorKind, GatewayError
from ..pipeline import StreamRenderer
from ..settings import ServerSettings
from ..streaming import sse_data

# `model` values that mean "whatever is served" (huggingface_hub sends "dummy" to a
# URL; TGI's clients send "tgi"); any other name must be one that is served.
PLACEHOLDER_MODEL_NAMES = ("", "default", "tgi", "dummy")


def served_model_names(settings: ServerSettings) -> list[str]:
    return list(dict.fromkeys((settings.model_id, *settings.served_model_names)))


def resolve_model(name: str | None, service) -> str:
    """The name to report for a request's `model` on `service` (a GenerationService, or its view
    bound to the LoRA adapter the name selected); 404 for a model that is not served."""
    settings = service.settings
    if name is not None and name == service.lora_name:
        return name
    if name is None or name in PLACEHOLDER_MODEL_NAMES:
        return settings.model_id
    if name in served_model_names(settings):
        return name
    raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"The model `{name}` does not exist. Served: "
                       f"{', '.join(served_model_names(settings))}", "model")


@dataclass(frozen=True)
class ResponseMeta:
    """The fields every response (and every chunk of a stream) carries."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, id_prefix: str, object_name: str, model: str, service) -> ResponseMeta:
        info = service.client.info  # None until the engine has started
        backend = info.backend if info is not None else "engine"
        return cls(f"{id_prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), model,
                   f"switchyard-{service.settings.version}-{backend}")

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}


def openai_finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's word for how a sequence ended (tool calls are relabelled by tool_output.py):
    `length` when cut off, `stop` for every natural end (EOS, a stop token or string, a
    complete grammar) and for an abort."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache,
    `reasoning_tokens` (chat) the completion tokens a reasoning model thought in."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


class CachedTokens:
    """Prompt tokens served from the cache, counted once per prompt: by the first
    sequence of each (siblings reuse its blocks and would count them again)."""

    def __init__(self, num_sequences: int):
        self._num_sequences = num_sequences
        self._by_prompt: dict[int, int] = {}

    def record(self, index: int, num_cached_tokens: int) -> None:
        if index % self._num_sequences == 0:
            self._by_prompt[index // self._num_sequences] = num_cached_tokens

    @property
    def total(self) -> int:
        return sum(self._by_prompt.values())


class ChunkBuilder:
    """Turns engine outputs into the payloads of a stream's chunks (chat, completions)."""

    def on_output(self, index: int, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def tail(self) -> list[dict]:
        """Payloads after every sequence finished (the usage chunk)."""
        return []


class OpenAIChunkEvents(StreamRenderer):
    """OpenAI's chunk stream: `data: {...}` per payload, an error as one
    `{"error": {...}}` event, then `data: [DONE]`."""

    def __init__(self, chunks: ChunkBuilder):
        self._chunks = chunks

    def on_output(self, index: int, out: RequestOutput) -> list[str]:
        return [sse_data(payload) for payload in self._chunks.on_output(index, out)]

    def tail(self) -> list[str]:
        return [sse_data(payload) for payload in self._chunks.tail()]

    def on_error(self, error: GatewayError) -> list[str]:
        return [sse_data({"error": {**error.openai_body()["error"], "http_status_code": error.openai_status}})]

    def end(self) -> list[str]:
        return [sse_data("[DONE]")]
