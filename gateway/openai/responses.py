"""POST /v1/responses: the OpenAI Responses API, stateless, on the chat pipeline.

    body -> ResponsesRequest -> chat_request (responses_request.py) -> submit_chat
    (the chat route's plan, prompt, limits, grammar check and submission)
    -> one `response` object (responses_output.py) or typed events (responses_stream.py)

Errors name the Responses fields (`text.format`, `max_output_tokens`, `input`)."""
from __future__ import annotations

from fastapi import Request

from ..errors import ErrorKind, GatewayError, SafeJSONResponse
from ..models_registry import service_for
from ..pipeline import Pipeline
from ..tokens import token_strings
from .chat import SubmittedChat, submit_chat
from .common import openai_finish_reason
from .logprobs import chat_logprob_entries
from .responses_output import ResponseFrame, output_items, responses_usage, status_of
from .responses_request import ResponsesRequest, chat_request, responses_error
from .responses_stream import ResponseEvents
from .reasoning import reasoned_message


async def create_response(req: ResponsesRequest, http_request: Request):
    service = await service_for(http_request, req.model)
    pipeline = Pipeline(service)
    admission, chat = await pipeline.start(lambda: _submit(service, req))
    frame = ResponseFrame(req, chat.model)
    strings = token_strings(service.tokenizer)
    want_logprobs = chat.plan.params.logprobs is not None
    headers = {"x-request-id": frame.id}
    if req.stream:
        events = ResponseEvents(frame, chat.plan.tools, strings, want_logprobs, chat.plan.reasoning)
        return pipeline.stream(admission, chat.streams, events, headers)
    completion, = await pipeline.collect(admission, chat.streams, http_request)
    message, _, num_reasoning = reasoned_message(chat.plan.reasoning, completion.text, completion.token_ids,
                                                 openai_finish_reason(completion.finish_reason), chat.plan.tools)
    logprobs = None
    if want_logprobs:
        logprobs = chat_logprob_entries(strings, completion.token_ids, completion.logprobs or (),
                                        completion.top_logprobs)
    status = status_of(completion.finish_reason)
    usage = responses_usage(len(chat.prompt_ids), len(completion.token_ids), completion.num_cached_tokens,
                            num_reasoning)
    body = frame.body(status, output_items(message, status, logprobs, chat.plan.tools), usage)
    return SafeJSONResponse(body, headers=headers)


async def _submit(service, req: ResponsesRequest) -> SubmittedChat:
    try:
        return await submit_chat(service, chat_request(req))
    except GatewayError as exc:
        raise responses_error(exc) from exc


def not_stored(response_id: str) -> GatewayError:
    """GET / cancel / delete of a response: nothing is kept, so there is nothing to find."""
    return GatewayError(ErrorKind.NOT_FOUND, f"No response with id {response_id!r}: this server does not store "
                        "responses (every response is answered with store: false)", "response_id")
