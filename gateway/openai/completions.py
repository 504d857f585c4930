"""POST /v1/completions: one or more prompts (text or token ids), n choices each
(the best n of best_of by cumulative log-probability), echo, legacy logprobs."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from switchyard.core.scheduling.request import RequestOutput

from ..errors import SafeJSONResponse, invalid
from ..models_registry import service_for
from ..pipeline import Pipeline, off_loop
from ..structured import compiled
from ..tokens import TokenStrings, token_strings
from .common import (CachedTokens, ChunkBuilder, OpenAIChunkEvents, ResponseMeta, openai_finish_reason,
                     resolve_model, usage)
from .logprobs import CompletionLogprobs, merge_fragments
from .params import EnginePlan, check_token_ids, completion_plan
from .schemas import CompletionRequest


@dataclass(frozen=True)
class Prompt:
    text: str  # what echo prepends
    ids: list[int]


async def create_completion(req: CompletionRequest, http_request: Request):
    service = await service_for(http_request, req.model)
    pipeline = Pipeline(service)

    async def prepare():
        model = resolve_model(req.model, service)
        plan = completion_plan(req, service.settings, len(service.tokenizer))
        prompts = await off_loop(_prompts, req, service)
        if plan.params.grammar is not None:
            await compiled(service.client, plan.params.grammar, plan.grammar_param)
        sequences = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            sequences += [(prompt.ids, p) for p in plan.sequence_params(service, len(prompt.ids), param)]
        return model, plan, prompts, await service.submit_all(sequences)

    admission, (model, plan, prompts, streams) = await pipeline.start(prepare)
    meta = ResponseMeta.new("cmpl", "text_completion", model, service)
    strings = token_strings(service.tokenizer)
    if req.stream:
        options = req.stream_options
        chunks = CompletionChunks(meta, strings, plan, req, prompts,
                                  include_usage=bool(options and options.include_usage),
                                  continuous_usage=bool(options and options.continuous_usage_stats))
        return pipeline.stream(admission, streams, OpenAIChunkEvents(chunks), {"x-request-id": meta.id})
    completions = await pipeline.collect(admission, streams, http_request)
    body = meta.body(_choices(req, plan, prompts, completions, strings),
                     usage=usage(sum(len(p.ids) for p in prompts),
                                 0 if plan.discard_output else sum(len(c.token_ids) for c in completions),
                                 sum(c.num_cached_tokens for c in completions[::plan.num_sequences])))
    return SafeJSONResponse(body, headers={"x-request-id": meta.id})


def _prompts(req: CompletionRequest, service) -> list[Prompt]:
    prompt = req.prompt
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise invalid("prompt must not be empty", "prompt")
    else:
        items = [prompt] if isinstance(prompt[0], int) else list(prompt)
    limit = service.settings.max_client_batch_size
    if len(items) > limit:
        raise invalid(f"at most {limit} prompts per request. Given: {len(items)}", "prompt")
    prompts = []
    vocab_size = len(service.tokenizer)
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt.{i}"
        if isinstance(item, str):
            text, ids = item, service.encode(item)
        else:
            ids = check_token_ids(item, vocab_size, param)
            text = None
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids, text = ids[-req.truncate_prompt_tokens:], None
        if text is None:
            text = service.tokenizer.decode(ids, skip_special_tokens=False)
        prompts.append(Prompt(text, ids))
    return prompts


def _choices(req: CompletionRequest, plan: EnginePlan, prompts: list[Prompt], completions, strings) -> list[dict]:
    choices = []
    per_prompt = plan.num_sequences
    for i, prompt in enumerate(prompts):
        sequences = completions[i * per_prompt:(i + 1) * per_prompt]
        if per_prompt > plan.num_choices:  # best_of: the n most likely
            sequences = sorted(sequences, key=lambda c: sum(c.logprobs or ()), reverse=True)[:plan.num_choices]
        for k, completion in enumerate(sequences):
            choices.append(_choice(i * plan.num_choices + k, req, plan, prompt, completion, strings))
    return choices


def _choice(index: int, req: CompletionRequest, plan: EnginePlan, prompt: Prompt, completion,
            strings: TokenStrings) -> dict:
    discard = plan.discard_output
    text = (prompt.text if req.echo else "") + ("" if discard else completion.text)
    logprobs = None
    if req.logprobs is not None:
        builder = CompletionLogprobs(strings)
        fragments = []
        if req.echo and completion.prompt_logprobs is not None:
            fragments.append(builder.prompt(completion.prompt_logprobs))
        if not discard:
            fragments.append(builder.generated(completion.token_ids, completion.logprobs or (),
                                               completion.top_logprobs))
        logprobs = merge_fragments(fragments)
    finish_reason = "length" if discard else openai_finish_reason(completion.finish_reason)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class CompletionChunks(ChunkBuilder):
    """`text_completion` chunks: the echoed prompt first, then text deltas; the last
    chunk of a choice carries its finish_reason; then the usage chunk if asked."""

    def __init__(self, meta: ResponseMeta, strings: TokenStrings, plan: EnginePlan, req: CompletionRequest,
                 prompts: list[Prompt], include_usage: bool, continuous_usage: bool):
        self._meta = meta
        self._strings = strings
        self._plan = plan
        self._echo = req.echo
        self._want_logprobs = req.logprobs is not None
        self._prompts = prompts
        self._include_usage = include_usage or continuous_usage
        self._continuous_usage = continuous_usage
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._num_output_tokens: dict[int, int] = {}
        self._cached = CachedTokens(plan.num_sequences)

    def on_output(self, index: int, out: RequestOutput) -> list[dict]:
        self._cached.record(index, out.num_cached_tokens)
        chunks = []
        if index not in self._logprobs:
            self._logprobs[index] = CompletionLogprobs(self._strings)
            if self._echo:
                chunks.append(self._echo_chunk(index, out))
        if self._plan.discard_output:
            return chunks + ([self._chunk(index, "", None, "length")] if out.finished else [])
        self._num_output_tokens[index] = out.num_output_tokens
        if out.new_text or out.finished or (self._want_logprobs and out.new_token_ids):
            logprobs = None
            if self._want_logprobs:
                logprobs = self._logprobs[index].generated(out.new_token_ids, out.logprobs or (), out.top_logprobs)
            finish_reason = openai_finish_reason(out.finish_reason) if out.finished else None
            chunks.append(self._chunk(index, out.new_text, logprobs, finish_reason))
        return chunks

    def tail(self) -> list[dict]:
        return [self._meta.body([], usage=self._usage())] if self._include_usage else []

    def _echo_chunk(self, index: int, out: RequestOutput) -> dict:
        prompt = self._prompts[index // self._plan.num_sequences]
        logprobs = None
        if self._want_logprobs and out.prompt_logprobs is not None:
            logprobs = self._logprobs[index].prompt(out.prompt_logprobs)
        return self._chunk(index, prompt.text, logprobs, None)

    def _usage(self) -> dict:
        return usage(sum(len(p.ids) for p in self._prompts), sum(self._num_output_tokens.values()),
                     self._cached.total)

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        extra = {}
        if self._include_usage:
            extra["usage"] = self._usage() if self._continuous_usage else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._meta.body([choice], **extra)
