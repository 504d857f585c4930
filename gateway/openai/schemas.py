"""Request bodies of the OpenAI dialect (pydantic): every field the OpenAI SDK sends
for chat completions and completions, plus the vLLM extras users rely on.

Parsing only checks types and simple ranges (pydantic names the field in its
error); what a field means, and whether it can be honoured, is decided in
`params.py`. Unknown fields are ignored, as OpenAI-compatible servers do; fields
we know but cannot honour are declared here so that `params.py` can reject them.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(BaseModel):
    """One part of a message's content: text (or refusal) is used; `image_url` parts are read for a
    model that takes images (images.py: the part's `image_url` is one of its extra fields); other
    kinds are rejected."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # an assistant turn's thinking, as this server returns it (vLLM's names): for the chat template
    reasoning_content: str | None = None
    reasoning: str | None = None
    # assistant audio replies and deprecated function calls cannot be rendered
    audio: Any = None
    function_call: Any = None


class StreamOptions(_Lenient):
    include_usage: bool | None = None
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # OpenAI pads chunks; we send no padding


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    json_schema: dict | None = None
    value: Any = None  # TGI's dialect: {"type": "json"|"regex"|..., "value": ...}


class SamplingFields(_Lenient):
    """What chat completions and completions share."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    typical_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # known extras that cannot be honoured yet (rejected with a 400 when set)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    tool_prompt: str | None = None  # TGI
    response_format: ResponseFormat | None = None
    # accepted: they only label, bill or cache the request
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: str | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    prediction: dict | None = None  # a latency hint: the output is the same without it
    # reaches the chat template of a reasoning model (messages.py); refused for any other model
    reasoning_effort: str | None = None
    # vLLM's: at most this many thinking tokens before the end-of-thinking marker is forced (-1: no
    # limit); refused for a model that does not reason (gateway/reasoning/plan.py)
    thinking_token_budget: int | None = Field(None, ge=-1)
    # cannot be honoured by a text-only local model
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None
    # vLLM chat extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    documents: list[dict] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM; rejected (use echo + logprobs)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One message for a wrong shape (pydantic would report each union branch)."""
        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(x, str) for x in value) or _token_ids(value)
                or all(isinstance(x, list) and _token_ids(x) for x in value))):
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids")


def _token_ids(values: list) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)
