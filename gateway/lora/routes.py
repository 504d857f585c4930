"""vLLM's run-time adapter routes, behind the API key: `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}, each answered, as vLLM
does, with a line of text; errors in OpenAI's shape (a 400, or a 404 for an adapter not loaded).
They change the adapters of the default model's engine (adapters.py does the checks)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from switchyard.core.errors import EngineDeadError, ValidationError

from ..auth import require_api_key
from ..errors import ErrorKind, GatewayError
from .adapters import AdapterNotFound

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


@router.post("/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraRequest, http_request: Request):
    service = http_request.app.state.service
    service.require_ready()
    await _changed(service.adapters.load(service.client, req.lora_name, req.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraRequest, http_request: Request):
    service = http_request.app.state.service
    service.require_ready()
    await _changed(service.adapters.unload(service.client, req.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _changed(change) -> None:
    """Await a load or unload; what the engine or the checks refused becomes the route's error."""
    try:
        await change
    except AdapterNotFound as exc:
        raise GatewayError(ErrorKind.NOT_FOUND, str(exc), "lora_name") from None
    except ValidationError as exc:
        raise GatewayError(ErrorKind.VALIDATION, str(exc), exc.param or "lora_path") from None
    except EngineDeadError as exc:
        raise GatewayError(ErrorKind.UNAVAILABLE, str(exc)) from None
    except (ValueError, OSError, KeyError) as exc:  # the engine's refusal of the adapter's files
        raise GatewayError(ErrorKind.VALIDATION, f"cannot load the LoRA adapter: {exc}", "lora_path") from None
