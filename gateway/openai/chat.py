"""POST /v1/chat/completions: one prompt (the rendered conversation), n choices.

A choice's message (text or tool calls) is built by tool_output.py, whole or as
stream deltas, from the answer a reasoning model's thinking is split from (reasoning.py);
a grammar (response_format, tools) is compiled before anything is submitted, so that one
the engine cannot honour is a 400 naming its field."""
from __future__ import annotations

from dataclasses import dataclass, replace

from fastapi import Request

from switchyard.core.engine.client import RequestStream
from switchyard.core.scheduling.request import RequestOutput

from ..errors import SafeJSONResponse
from ..media import load_images
from ..models_registry import service_for
from ..pipeline import Pipeline, off_loop
from ..reasoning import plan_reasoning
from ..structured import compiled
from ..tokens import TokenStrings, token_strings
from ..tool_parsers import served_tool_format
from .common import (CachedTokens, ChunkBuilder, OpenAIChunkEvents, ResponseMeta, openai_finish_reason,
                     resolve_model, usage)
from .logprobs import chat_logprob_entries
from .images import image_refs
from .messages import chat_prompt, takes_images
from .params import EnginePlan, chat_plan
from .reasoning import ReasonedDeltas, reasoned_message
from .schemas import ChatCompletionRequest


@dataclass(frozen=True)
class SubmittedChat:
    """A chat request on its way: the model name to report, the plan, the prompt, the streams."""

    model: str
    plan: EnginePlan
    prompt_ids: list[int]
    streams: list[RequestStream]


async def submit_chat(service, req: ChatCompletionRequest) -> SubmittedChat:
    """Parse (one plan, SamplingParams built once), render and tokenize off the event
    loop, check the lengths, pre-compile the grammar, submit every sequence."""
    model = resolve_model(req.model, service)
    plan = chat_plan(req, service.settings, len(service.tokenizer), served_tool_format(service))
    plan, prompt_ids = await prepared_prompt(service, req, plan)
    params = plan.sequence_params(service, len(prompt_ids), "messages")
    if plan.params.grammar is not None:
        await compiled(service.client, plan.params.grammar, plan.grammar_param)
    streams = await service.submit_all([(prompt_ids, p) for p in params], images=plan.images)
    return SubmittedChat(model, plan, prompt_ids, streams)


async def prepared_prompt(service, req: ChatCompletionRequest, plan: EnginePlan) -> tuple[EnginePlan, list[int]]:
    """The prompt rendered and tokenized off the event loop, and the plan for its output
    (a reasoning model's: gateway/reasoning)."""
    refs = image_refs(req.messages) if takes_images(service) else []
    images = await load_images(refs, service.settings.media) if refs else ()
    prompt_text, prompt_ids = await off_loop(chat_prompt, service, req, plan.tools)
    plan = replace(plan, images=images)
    return plan.reasoned(plan_reasoning(service, prompt_text, plan.params, req.skip_special_tokens)), prompt_ids


async def create_chat_completion(req: ChatCompletionRequest, http_request: Request):
    service = await service_for(http_request, req.model)
    pipeline = Pipeline(service)
    admission, chat = await pipeline.start(lambda: submit_chat(service, req))
    meta = ResponseMeta.new("chatcmpl", "chat.completion", chat.model, service)
    strings = token_strings(service.tokenizer)
    if req.stream:
        options = req.stream_options
        chunks = ChatChunks(meta, strings, chat.plan, len(chat.prompt_ids),
                            include_usage=bool(options and options.include_usage),
                            continuous_usage=bool(options and options.continuous_usage_stats))
        return pipeline.stream(admission, chat.streams, OpenAIChunkEvents(chunks), {"x-request-id": meta.id})
    completions = await pipeline.collect(admission, chat.streams, http_request)
    choices = [_choice(i, c, strings, chat.plan) for i, c in enumerate(completions)]
    extra = {"service_tier": "default"} if req.service_tier is not None else {}
    body = meta.body([choice for choice, _ in choices],
                     usage=usage(completions[0].num_prompt_tokens, sum(len(c.token_ids) for c in completions),
                                 completions[0].num_cached_tokens, sum(n for _, n in choices)), **extra)
    return SafeJSONResponse(body, headers={"x-request-id": meta.id})


def _choice(index: int, completion, strings: TokenStrings, plan: EnginePlan) -> tuple[dict, int]:
    """A choice, and its number of reasoning tokens."""
    logprobs = None
    if plan.params.logprobs is not None:
        logprobs = {"content": chat_logprob_entries(strings, completion.token_ids, completion.logprobs or (),
                                                    completion.top_logprobs),
                    "refusal": None}
    message, finish_reason, num_reasoning = reasoned_message(
        plan.reasoning, completion.text, completion.token_ids, openai_finish_reason(completion.finish_reason),
        plan.tools)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}, num_reasoning


class ChatChunks(ChunkBuilder):
    """`chat.completion.chunk` payloads: per choice a role delta, content deltas (with
    their tokens' log-probabilities), a finish chunk; then the usage chunk if asked."""

    def __init__(self, meta: ResponseMeta, strings: TokenStrings, plan: EnginePlan, num_prompt_tokens: int,
                 include_usage: bool, continuous_usage: bool):
        self._meta = ResponseMeta(meta.id, "chat.completion.chunk", meta.created, meta.model,
                                  meta.system_fingerprint)
        self._strings = strings
        self._want_logprobs = plan.params.logprobs is not None
        self._tools = plan.tools
        self._reasoning = plan.reasoning
        self._num_prompt_tokens = num_prompt_tokens
        self._include_usage = include_usage or continuous_usage
        self._continuous_usage = continuous_usage
        self._choices: dict[int, ReasonedDeltas] = {}
        self._num_output_tokens: dict[int, int] = {}
        self._cached = CachedTokens(plan.num_sequences)

    def on_output(self, index: int, out: RequestOutput) -> list[dict]:
        self._num_output_tokens[index] = out.num_output_tokens
        self._num_prompt_tokens = out.num_prompt_tokens  # the engine's count: images expanded
        self._cached.record(index, out.num_cached_tokens)
        chunks = []
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = ReasonedDeltas(self._reasoning, self._tools)
            chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
        deltas = choice.feed(out.new_text, out.new_token_ids, self._logprob_entries(out))
        finish_reason = None
        if out.finished:
            last, finish_reason = choice.finish(openai_finish_reason(out.finish_reason))
            deltas += last
        chunks += [self._chunk(index, delta, _logprobs(entries)) for delta, entries in deltas]
        if out.finished:
            chunks.append(self._chunk(index, {}, finish_reason=finish_reason))
        return chunks

    def tail(self) -> list[dict]:
        if not self._include_usage:
            return []
        return [self._meta.body([], usage=self._usage())]

    def _logprob_entries(self, out: RequestOutput) -> list | None:
        if not self._want_logprobs or not out.new_token_ids:
            return None
        return chat_logprob_entries(self._strings, out.new_token_ids, out.logprobs or (), out.top_logprobs)

    def _usage(self) -> dict:
        return usage(self._num_prompt_tokens, sum(self._num_output_tokens.values()), self._cached.total,
                     sum(choice.num_reasoning_tokens for choice in self._choices.values()))

    def _chunk(self, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None):
        extra = {}
        if self._include_usage:
            extra["usage"] = self._usage() if self._continuous_usage else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._meta.body([choice], **extra)


def _logprobs(entries: list | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}
