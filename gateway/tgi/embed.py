"""POST /embed: Hugging Face text-embeddings-inference's route, over gateway/embeddings.py.

Body `{inputs: str | [str], normalize = true, truncate = false, truncation_direction =
"Right" | "Left", dimensions?, prompt_name?}`; the answer is a list of vectors, one per input.
As TEI, `normalize` defaults to true whatever the model's own files say; `truncate` cuts an
input to the model's limit, keeping its start ("Right") or its end ("Left"), else a longer one
is refused. Errors in TEI's (TGI's) shape, `{error, error_type}`. `prompt_name` (a
sentence-transformers prompt prepended server-side) is refused: the client adds its prompt."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from switchyard.core.pooling.params import PoolingParams

from ..auth import require_api_key
from ..embeddings import EmbeddingInputs, embed
from ..errors import SafeJSONResponse, invalid
from ..models_registry import service_for, tgi_model_name

router = APIRouter()


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    dimensions: int | None = Field(None, ge=1)
    prompt_name: str | None = None


@router.post("/embed", dependencies=[Depends(require_api_key)])
async def embed_route(body: EmbedRequest, request: Request):
    service = await service_for(request, tgi_model_name(request))
    if body.prompt_name is not None:
        raise invalid("prompt_name is not supported: prepend the prompt to each input", "prompt_name")
    items = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
    keep = "start" if body.truncation_direction.lower() == "right" else "end"
    inputs = EmbeddingInputs(items, "inputs", truncate=keep if body.truncate else None)
    outputs = await embed(service, request, inputs, PoolingParams(dimensions=body.dimensions,
                                                                  normalize=body.normalize))
    return SafeJSONResponse([out.embedding.tolist() for out in outputs])
