"""POST /v1/embeddings: OpenAI's embeddings API (with vLLM's extras), over gateway/embeddings.py.

`input`: a string, a list of strings, a list of token ids or a list of lists of token ids
(LangChain's OpenAIEmbeddings sends token ids by default). `encoding_format`: "float" (lists
of numbers) or "base64" (the little-endian float32 bytes, base64-encoded: what the OpenAI SDK
asks for by default, and decodes itself). `dimensions`: a Matryoshka model's embedding cut to
that size and normalised again; a 400 where the model cannot. vLLM's extras: `normalize`,
`truncate_prompt_tokens` (keep an input's last n tokens; -1: the model's limit) and
`add_special_tokens`. `user` is accepted and ignored."""
from __future__ import annotations

import base64
import sys
from array import array
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from switchyard.core.pooling.params import PoolingParams

from ..embeddings import EmbeddingInputs, embed
from ..errors import SafeJSONResponse
from ..models_registry import service_for
from .common import resolve_model


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        """One message for a wrong shape (pydantic would report each union branch)."""
        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(x, str) for x in value) or _token_ids(value)
                or all(isinstance(x, list) and _token_ids(x) for x in value))):
            return value
        raise ValueError("input must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids")


def _token_ids(values: list) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def _inputs(req: EmbeddingRequest) -> EmbeddingInputs:
    value = req.input
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    truncate_to = req.truncate_prompt_tokens
    return EmbeddingInputs(items, "input", req.add_special_tokens,
                           truncate=None if truncate_to is None else "end",
                           truncate_to=None if truncate_to in (None, -1) else truncate_to)


def encoded(vector: array, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI writes it: numbers, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector.tolist()
    if sys.byteorder != "little":
        vector = array("f", vector)
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")


async def create_embeddings(req: EmbeddingRequest, http_request: Request):
    service = await service_for(http_request, req.model)
    model = resolve_model(req.model, service)  # a model that is not served: 404 before anything
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    outputs = await embed(service, http_request, _inputs(req), params)
    data = [{"object": "embedding", "index": i, "embedding": encoded(out.embedding, req.encoding_format)}
            for i, out in enumerate(outputs)]
    prompt_tokens = sum(out.num_prompt_tokens for out in outputs)
    return SafeJSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
