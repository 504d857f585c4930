"""Routes of the Anthropic dialect: POST /v1/messages and /v1/messages/count_tokens.

Both take the API key as Anthropic's clients send it: `x-api-key` (the SDK's `api_key`,
Claude Code's ANTHROPIC_API_KEY) or `Authorization: Bearer` (the SDK's `auth_token`,
Claude Code's ANTHROPIC_AUTH_TOKEN). The `anthropic-version` and `anthropic-beta`
headers are accepted and not read: there is one version of this API here. Errors are
rendered in Anthropic's shape (errors.py)."""
from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, Request

from ..auth import bearer_matches
from ..errors import ErrorKind, GatewayError
from . import errors as _errors  # noqa: F401 - registers the dialect's error rendering
from .messages import count_tokens, create_message
from .request import CountTokensRequest, MessagesRequest

API_KEY_HEADER = "x-api-key"


def require_api_key(request: Request) -> None:
    """`x-api-key: <--api-key>` or `Authorization: Bearer <--api-key>`."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    given = request.headers.get(API_KEY_HEADER)
    if given is not None and hmac.compare_digest(given.strip().encode(), key.encode()):
        return
    if bearer_matches(request.headers.get("authorization", ""), key):
        return
    raise GatewayError(ErrorKind.AUTHENTICATION, f"invalid or missing API key ({API_KEY_HEADER} or "
                       "Authorization: Bearer ...)")


router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.post("/messages")
async def messages(req: MessagesRequest, http_request: Request):
    return await create_message(req, http_request)


@router.post("/messages/count_tokens")
async def messages_count_tokens(req: CountTokensRequest, http_request: Request) -> dict:
    return await count_tokens(req, http_request)
