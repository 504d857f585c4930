"""Request bodies of the TGI dialect (router/src/lib.rs `GenerateRequest`,
`GenerateParameters`, `CompatGenerateRequest`).

Types are checked here (a wrong type is a 422 naming the field); ranges and
limits are checked in `validation.py` with TGI's own messages. Unknown fields are
ignored, as serde does. Clients send `null` for fields they leave unset (the
`text-generation` client sends every field), so every field accepts `null` and
takes its default.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_U64_MAX = (1 << 64) - 1


class Grammar(BaseModel):
    """`{"type": "json" | "json_object" | "regex" | "json_schema", "value": ...}`."""

    model_config = ConfigDict(extra="ignore")
    type: str
    value: Any = None


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None  # None: the room left in --max-total-tokens
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(None, ge=0, le=_U64_MAX)
    top_n_tokens: int | None = None
    grammar: Grammar | None = None
    adapter_id: str | None = None

    @field_validator("do_sample", "watermark", "details", "decoder_input_details", mode="before")
    @classmethod
    def _null_is_false(cls, value):
        return False if value is None else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value


def default_parameters() -> GenerateParameters:
    """What TGI uses when `parameters` is omitted altogether: note `do_sample=true`."""
    return GenerateParameters(do_sample=True)


class GenerateRequest(BaseModel):
    """Body of `/generate`, `/generate_stream` and `/tokenize`."""

    model_config = ConfigDict(extra="ignore")
    inputs: str
    parameters: GenerateParameters = Field(default_factory=default_parameters)

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_parameters(cls, value):
        return default_parameters() if value is None else value


class CompatGenerateRequest(GenerateRequest):
    """Body of `POST /`: a `/generate` body plus `stream`."""

    stream: bool = False

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, value):
        return False if value is None else value

