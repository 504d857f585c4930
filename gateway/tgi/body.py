"""Bodies of routes that dispatch on the body's shape (`/invocations`, `/tokenize`):
parsed by hand, with the same 422 naming the field as FastAPI's own bodies."""
from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError

from ..errors import ErrorKind, GatewayError

Model = TypeVar("Model", bound=pydantic.BaseModel)


async def json_object(request: Request) -> dict:
    """The body as a JSON object, or a 422 saying why it is not one."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        position = getattr(exc, "pos", 0)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", position),
                                       "msg": f"JSON decode error: {exc}", "input": {}}]) from exc
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.VALIDATION, "the body must be a JSON object")
    return body


def parse(model: type[Model], body: dict) -> Model:
    """`model` from `body`; a type error is a 422 naming the field, like FastAPI's."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        errors = [{**error, "loc": ("body", *error.get("loc", ()))} for error in exc.errors()]
        raise RequestValidationError(errors) from exc
