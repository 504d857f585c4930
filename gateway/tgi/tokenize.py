"""`/tokenize` and `/chat_tokenize`.

`/tokenize` answers TGI's body (`{inputs, parameters?}` -> `[{id, text, start,
stop}]`, character offsets into `inputs`) and also vLLM's (`{prompt | messages,
add_special_tokens?, return_token_strs?}` -> `{count, max_model_len, tokens,
token_strs?}`), told apart by the body.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from ..auth import require_api_key
from ..errors import ErrorKind, GatewayError, SafeJSONResponse
from ..models_registry import service_for, tgi_model_name
from ..service import GenerationService
from .body import json_object, parse
from ..openai.messages import chat_prompt_text
from ..openai.schemas import ChatCompletionRequest
from ..openai.tools import tool_plan
from ..tool_parsers import served_tool_format
from .schemas import GenerateRequest

router = APIRouter()


class VllmTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


async def _service(request: Request) -> GenerationService:
    """The model the request names (X-Model header or ?model=; gateway/models_registry.py), else the default."""
    return await service_for(request, tgi_model_name(request))


def simple_tokens(tokenizer, text: str, add_special_tokens: bool, keep_last: int | None = None) -> list[dict]:
    """TGI's SimpleTokens: id, the text it covers and its [start, stop) character offsets."""
    if not getattr(tokenizer, "is_fast", False):  # offsets need a fast tokenizer, as in TGI
        raise GatewayError(ErrorKind.NOT_FOUND, "No fast tokenizer available")
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    pairs = list(zip(encoding["input_ids"], encoding["offset_mapping"]))
    if keep_last is not None:
        pairs = pairs[-keep_last:]
    return [{"id": token_id, "text": text[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in pairs]


def render(service: GenerationService, chat: ChatCompletionRequest) -> str:
    """The chat template applied to a chat request's messages (and tools), as
    /v1/chat/completions renders them."""
    return chat_prompt_text(service, chat, tool_plan(chat, service.settings, served_tool_format(service)))


@router.post("/tokenize", dependencies=[Depends(require_api_key)])
async def tokenize(request: Request):
    body = await json_object(request)
    service = await _service(request)
    service.require_ready()
    if "inputs" not in body and ("prompt" in body or "messages" in body):
        return SafeJSONResponse(_vllm_tokenize(service, parse(VllmTokenizeRequest, body), body))
    req = parse(GenerateRequest, body)
    truncate = req.parameters.truncate
    if truncate is not None and truncate <= 0:
        raise GatewayError(ErrorKind.VALIDATION, f"`truncate` must be strictly positive. Given: {truncate}",
                           "truncate")
    return SafeJSONResponse(simple_tokens(service.tokenizer, req.inputs, True, truncate))


def _vllm_tokenize(service: GenerationService, req: VllmTokenizeRequest, body: dict) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise GatewayError(ErrorKind.VALIDATION, "give exactly one of `prompt` and `messages`", "prompt")
    if req.messages is not None:
        text = render(service, parse(ChatCompletionRequest, body))
        add_special = bool(req.add_special_tokens)
    else:
        text = req.prompt
        add_special = req.add_special_tokens is not False
    ids = service.encode(text, add_special_tokens=add_special)
    body: dict = {"count": len(ids), "max_model_len": service.limits.max_total_tokens, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = service.tokenizer.convert_ids_to_tokens(ids)
    return body


@router.post("/chat_tokenize", dependencies=[Depends(require_api_key)])  # like /tokenize
async def chat_tokenize(body: ChatCompletionRequest, request: Request) -> SafeJSONResponse:
    """The chat template applied to a chat request, and the tokens of the result."""
    service = await _service(request)
    service.require_ready()
    templated = render(service, body)
    tokens = simple_tokens(service.tokenizer, templated, add_special_tokens=False)
    return SafeJSONResponse({"tokenize_response": tokens, "templated_text": templated})
