"""Routes of the OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/responses,
/v1/embeddings, /v1/models.

All of them take the API key (the OpenAI SDK always sends it). Errors are rendered
by the app in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..auth import require_api_key
from ..errors import ErrorKind, GatewayError
from .chat import create_chat_completion
from .common import served_model_names
from .completions import create_completion
from .embeddings import EmbeddingRequest, create_embeddings
from .responses import create_response, not_stored
from .responses_request import ResponsesRequest
from .schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
_STARTED = int(time.time())


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, http_request: Request):
    return await create_chat_completion(req, http_request)


@router.post("/completions")
async def completions(req: CompletionRequest, http_request: Request):
    return await create_completion(req, http_request)


@router.post("/embeddings")
async def embeddings(req: EmbeddingRequest, http_request: Request):
    return await create_embeddings(req, http_request)


@router.post("/responses")
async def responses(req: ResponsesRequest, http_request: Request):
    return await create_response(req, http_request)


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str):
    raise not_stored(response_id)


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str):
    raise not_stored(response_id)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str):
    raise not_stored(response_id)


@router.get("/models")
async def list_models(http_request: Request) -> dict:
    return {"object": "list", "data": _model_cards(http_request)}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, http_request: Request) -> dict:
    for card in _model_cards(http_request):
        if card["id"] == model_id:
            return card
    raise GatewayError(ErrorKind.NOT_FOUND, f"The model `{model_id}` does not exist", "model")


def _model_cards(http_request: Request) -> list[dict]:
    registry = http_request.app.state.models
    if registry is not None:  # several models (gateway/models_registry.py): every one, loaded or not
        return [card for entry in registry.entries.values() for card in _cards_of(entry.spec.name, entry.service)]
    return _cards_of(None, http_request.app.state.service)


def _cards_of(name: str | None, service) -> list[dict]:
    """A model's cards: its names (`name`, or the single model's served names); `service` None: not loaded."""
    if service is None:
        return [{"id": name, "object": "model", "created": _STARTED, "owned_by": "switchyard", "root": name,
                 "parent": None, "max_model_len": None}]
    settings = service.settings
    info = service.client.info
    max_model_len = service.limits.max_total_tokens if info is not None else None
    cards = [{"id": name, "object": "model", "created": _STARTED, "owned_by": "switchyard",
              "root": settings.model_id, "parent": None, "max_model_len": max_model_len}
             for name in served_model_names(settings)]
    # its LoRA adapters (gateway/lora), as vLLM lists them: the adapter's path as root, the base as parent
    return cards + [{"id": adapter, "object": "model", "created": _STARTED, "owned_by": "switchyard",
                     "root": path, "parent": settings.model_id, "max_model_len": max_model_len}
                    for adapter, path in service.adapters.items()]
