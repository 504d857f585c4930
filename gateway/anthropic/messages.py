"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, stateless,
on the chat pipeline.

    body -> MessagesRequest -> chat_request (request.py) -> the chat route's plan and
    prompt (params.py, messages.py), the request's max_tokens fitted into the context,
    the grammar check, submission -> one `message` (output.py) or events (stream.py)

Errors name Anthropic's fields (`stop_sequences`, `tools.0.input_schema`, `max_tokens`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from fastapi import Request

from switchyard.core.engine.client import RequestStream

from ..errors import GatewayError, SafeJSONResponse
from ..models_registry import service_for
from ..openai.chat import prepared_prompt
from ..openai.common import openai_finish_reason, resolve_model
from ..openai.messages import chat_prompt_ids
from ..openai.params import EnginePlan, chat_plan
from ..openai.reasoning import reasoned_message
from ..openai.tools import tool_plan
from ..pipeline import Pipeline, off_loop
from ..reasoning.plan import served_format
from ..structured import compiled
from ..tool_parsers import served_tool_format
from .output import MessageFrame, content_blocks, matched_stop_sequence, stop_reason, usage
from .request import CountTokensRequest, MessagesRequest, anthropic_error, chat_request
from .stream import MessageEvents


@dataclass(frozen=True)
class SubmittedMessage:
    """A message on its way: the model name to report, the plan, the prompt, its stream."""

    model: str
    plan: EnginePlan
    prompt_ids: list[int]
    streams: list[RequestStream]
    context_bound: bool  # max_tokens was cut to the room the prompt leaves in the context


async def submit_message(service, req: MessagesRequest) -> SubmittedMessage:
    """The chat route's steps (submit_chat), but for max_tokens: Anthropic's clients ask for
    more than a small model's context holds (Claude Code: 32000), so it is fitted into the
    room the prompt leaves (stop_reason `model_context_window_exceeded` if that ends it),
    where the chat route refuses it."""
    chat = chat_request(req)  # its errors name Anthropic's fields already
    try:
        model = resolve_model(chat.model, service)
        plan = replace(chat_plan(chat, service.settings, len(service.tokenizer), served_tool_format(service)), default_max_tokens=req.max_tokens)
        if served_format(service) is None:  # clients send a budget with thinking on to any model: one
            plan = replace(plan, thinking_budget=None)  # that does not reason ignores both
        plan, prompt_ids = await prepared_prompt(service, chat, plan)
        params, = plan.sequence_params(service, len(prompt_ids), "messages")
        if plan.params.grammar is not None:
            await compiled(service.client, plan.params.grammar, plan.grammar_param)
        streams = await service.submit_all([(prompt_ids, params)], images=plan.images)
    except GatewayError as exc:
        raise anthropic_error(exc) from exc
    return SubmittedMessage(model, plan, prompt_ids, streams, params.max_tokens < req.max_tokens)


async def create_message(req: MessagesRequest, http_request: Request):
    service = await service_for(http_request, req.model)
    pipeline = Pipeline(service)
    admission, submitted = await pipeline.start(lambda: submit_message(service, req))
    frame = MessageFrame(submitted.model)
    headers = {"request-id": frame.id}
    stop_sequences = list(req.stop_sequences or ())
    if req.stream:
        events = MessageEvents(frame, submitted.plan.tools, len(submitted.prompt_ids), submitted.context_bound,
                               stop_sequences, service.tokenizer, submitted.plan.reasoning)
        return pipeline.stream(admission, submitted.streams, events, headers)
    completion, = await pipeline.collect(admission, submitted.streams, http_request)
    message, _, _ = reasoned_message(submitted.plan.reasoning, completion.text, completion.token_ids,
                                     openai_finish_reason(completion.finish_reason), submitted.plan.tools)
    content = content_blocks(message)
    reason = stop_reason(completion.finish_reason, any(block["type"] == "tool_use" for block in content),
                         submitted.context_bound)
    stop_sequence = None
    if reason == "stop_sequence":
        stop_sequence = matched_stop_sequence(stop_sequences, completion.token_ids, service.tokenizer)
    body = frame.body(content, reason, stop_sequence,
                      usage(len(submitted.prompt_ids), len(completion.token_ids), completion.num_cached_tokens))
    return SafeJSONResponse(body, headers=headers)


async def count_tokens(req: CountTokensRequest, http_request: Request) -> dict:
    """`{"input_tokens": N}`: the prompt /v1/messages renders for the same body, tokenized."""
    service = await service_for(http_request, req.model)
    service.require_ready()
    chat = chat_request(req)
    try:
        resolve_model(chat.model, service)
        prompt_ids = await off_loop(chat_prompt_ids, service, chat, tool_plan(chat, service.settings, served_tool_format(service)))
    except GatewayError as exc:
        raise anthropic_error(exc) from exc
    return {"input_tokens": len(prompt_ids)}
