"""TGIS's request parameters (`fmaas.Parameters`) checked and turned into one plan per
prompt: the prompt's ids, its `SamplingParams` (built once, validated in core), what the
response carries, and the limits. The same rules as the HTTP dialects, from the same places:
--max-stop-sequences, --max-top-n-tokens, --max-client-batch-size, the token limits
(`GenerationService.check_lengths`), --disable-grammar-support and the grammar checks of
gateway/structured.py. Every refusal is a VALIDATION GatewayError (INVALID_ARGUMENT) naming
the proto field.

TGIS's defaults: max_new_tokens 0 means 20, a zero top_p / typical_p / repetition_penalty
means off, GREEDY ignores the sampling parameters, an unset temperature is 1.0 and 0.0 is
greedy, stop sequences are kept in the text unless include_stop_sequence is false. A sampled
request without a seed gets one drawn here, so the seed reported makes it reproducible.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.core.grammar import GrammarSpec
from switchyard.core.params import SamplingParams, ValidationError

from ..errors import invalid
from ..service import GenerationService
from ..settings import ServerSettings
from ..structured import check_enabled, choice_spec, regex_spec, schema_spec
from .proto import generation_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 20  # TGIS: "Default (0) is currently 20"


@dataclass(frozen=True)
class ResponseOptions:
    """What each GenerationResponse carries besides the text (TGIS's ResponseOptions)."""

    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0


@dataclass(frozen=True)
class GrpcPlan:
    """One prompt of a TGIS request, validated: what to submit and what to report."""

    text: str
    prompt_ids: list[int]
    params: SamplingParams
    options: ResponseOptions
    sampling: bool  # the seed is reported only when sampling
    time_limit_s: float | None  # TGIS's time_limit_millis; None: no limit
    max_total_tokens: int  # a LENGTH finish at this many tokens is TOKEN_LIMIT, not MAX_TOKENS

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return self.params.stop


@dataclass(frozen=True)
class RequestParams:
    """The parts of `fmaas.Parameters` that are the same for every prompt of a request."""

    base: dict  # SamplingParams keyword arguments, without max_tokens
    max_new_tokens: int
    truncate: int | None
    options: ResponseOptions
    sampling: bool
    time_limit_s: float | None


def adapter_service(request, service):
    """The service a request runs on: the LoRA adapter's view of it for `adapter_id` (gateway/lora).
    `prefix_id` (TGIS's prompt-tuning prefixes) is not served."""
    if request.HasField("prefix_id") and request.prefix_id not in ("", service.settings.model_id):
        raise invalid(f"prompt prefixes are not supported: `prefix_id` must be unset. Given: {request.prefix_id!r}",
                      "prefix_id")
    return service.with_adapter(request.adapter_id if request.HasField("adapter_id") else None)


def check_batch(count: int, settings: ServerSettings) -> None:
    if count == 0:
        raise invalid("`requests` must hold at least one request", "requests")
    if count > settings.max_client_batch_size:
        raise invalid(f"`requests` holds {count} requests; at most {settings.max_client_batch_size} are allowed "
                      "(--max-client-batch-size)", "requests")


def request_params(p: pb.Parameters, settings: ServerSettings) -> RequestParams:
    """Check everything of `p` that does not depend on the prompt."""
    options = _options(p.response, settings)
    sampling = p.method == pb.SAMPLE
    base: dict = dict(_sampling(p.sampling) if sampling else {"temperature": 0.0})
    if sampling and base["temperature"] == 0.0:
        sampling = False  # temperature 0 is greedy, as in TGIS
        base = {"temperature": 0.0}
    if sampling:
        base["seed"] = p.sampling.seed if p.sampling.HasField("seed") else random.getrandbits(63)
    base.update(_decoding(p.decoding, settings))
    stopping = p.stopping
    max_new_tokens = stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if stopping.min_new_tokens > max_new_tokens:
        raise invalid(f"`min_new_tokens` ({stopping.min_new_tokens}) must not exceed `max_new_tokens` "
                      f"({max_new_tokens})", "min_new_tokens")
    stops = tuple(stopping.stop_sequences)
    if len(stops) > settings.max_stop_sequences:
        raise invalid(f"`stop_sequences` supports up to {settings.max_stop_sequences} stop sequences. "
                      f"Given: {len(stops)}", "stop_sequences")
    if any(not s for s in stops):
        raise invalid("`stop_sequences` must not hold an empty string", "stop_sequences")
    include_stop = stopping.include_stop_sequence if stopping.HasField("include_stop_sequence") else True
    base.update(min_tokens=stopping.min_new_tokens, stop=stops, include_stop_str_in_output=include_stop,
                logprobs=_logprobs(options, settings, options.generated_tokens),
                prompt_logprobs=_logprobs(options, settings, options.input_tokens))
    return RequestParams(base=base, max_new_tokens=max_new_tokens, truncate=p.truncate_input_tokens or None,
                         options=options, sampling=sampling,
                         time_limit_s=stopping.time_limit_millis / 1000 if stopping.time_limit_millis else None)


def plan_prompt(service: GenerationService, text: str, rp: RequestParams) -> GrpcPlan:
    """Tokenize one prompt (off the event loop: the caller runs this in a thread) and apply
    the token limits to it."""
    if not text:
        raise invalid("the request's `text` must not be empty", "text")
    prompt_ids = service.encode(text)
    if rp.truncate is not None:
        prompt_ids = prompt_ids[-rp.truncate:]
    max_new_tokens = service.check_lengths(len(prompt_ids), rp.max_new_tokens, "text")
    try:
        params = SamplingParams(max_tokens=max_new_tokens, **rp.base)
    except ValidationError as exc:
        raise invalid(str(exc), exc.param) from exc
    return GrpcPlan(text=text, prompt_ids=prompt_ids, params=params, options=rp.options, sampling=rp.sampling,
                    time_limit_s=rp.time_limit_s, max_total_tokens=service.limits.max_total_tokens)


def _options(r: pb.ResponseOptions, settings: ServerSettings) -> ResponseOptions:
    if r.top_n_tokens > settings.max_top_n_tokens:
        raise invalid(f"`top_n_tokens` must be <= {settings.max_top_n_tokens} (--max-top-n-tokens). "
                      f"Given: {r.top_n_tokens}", "top_n_tokens")
    return ResponseOptions(input_text=r.input_text, generated_tokens=r.generated_tokens,
                           input_tokens=r.input_tokens, token_logprobs=r.token_logprobs,
                           token_ranks=r.token_ranks, top_n_tokens=r.top_n_tokens)


def _logprobs(options: ResponseOptions, settings: ServerSettings, wanted: bool) -> int | None:
    """How many alternatives the engine reports per token: the top-n asked for; for ranks, at
    least --max-top-n-tokens (a token's rank is known when it is among them)."""
    if not wanted:
        return None
    if options.token_ranks:
        return max(options.top_n_tokens, settings.max_top_n_tokens)
    return options.top_n_tokens


def _sampling(s: pb.SamplingParameters) -> dict:
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if temperature < 0.0:
        raise invalid(f"`temperature` must be >= 0 (0 is greedy). Given: {temperature:g}", "temperature")
    if not 0.0 <= s.top_p <= 1.0:
        raise invalid(f"`top_p` must be in [0, 1] (0 is off). Given: {s.top_p:g}", "top_p")
    if not 0.0 <= s.typical_p <= 1.0:
        raise invalid(f"`typical_p` must be in [0, 1] (0 is off). Given: {s.typical_p:g}", "typical_p")
    return {"temperature": temperature, "top_k": s.top_k, "top_p": s.top_p or 1.0, "typical_p": s.typical_p or 1.0}


def _decoding(d: pb.DecodingParameters, settings: ServerSettings) -> dict:
    if d.repetition_penalty < 0.0:
        raise invalid(f"`repetition_penalty` must be > 0 (0 is off). Given: {d.repetition_penalty:g}",
                      "repetition_penalty")
    if d.HasField("length_penalty"):
        raise invalid("`length_penalty` is not supported: leave it unset", "length_penalty")
    return {"repetition_penalty": d.repetition_penalty or 1.0, "grammar": _grammar(d, settings)}


def _grammar(d: pb.DecodingParameters, settings: ServerSettings) -> GrammarSpec | None:
    """The guided-decoding oneof as a checked GrammarSpec (the engine compiles it before submission)."""
    which = d.WhichOneof("guided")
    if which is None or (which == "format" and d.format == pb.DecodingParameters.TEXT):
        return None
    check_enabled(settings, which)
    if which == "format":
        return GrammarSpec.json_object()
    if which == "json_schema":
        return schema_spec(d.json_schema, which)
    if which == "regex":
        return regex_spec(d.regex, which)
    if which == "choice":
        return choice_spec(list(d.choice.choices), which)
    raise invalid("context-free `grammar` is not supported: use `json_schema`, `regex`, `choice` or `format`",
                  which)
