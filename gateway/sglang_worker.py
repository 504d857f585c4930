"""SGLang's worker endpoints, so that `switchyard serve` workers can stand behind the SGLang
router (`sglang-router`, its regular HTTP-worker mode) like SGLang's own servers.

What the router calls on a worker, and what answers it here:

- `GET /health` (the app's): its health checks, and the wait for a worker at start-up.
- `GET /server_info` and `/model_info` (and the older `/get_server_info`, `/get_model_info`):
  read once when a worker is registered, for the model's name (the router's `/v1/models`).
- `GET /get_load`: the load monitor (the `power_of_two` policy); one entry per
  data-parallel rank, SGLang's shape: `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}`.
- `GET /health_generate`: a one-token generation, as SGLang's.
- `POST /generate`: SGLang's native dialect (`text` or `input_ids`, `sampling_params`,
  `stream`). This route comes before TGI's own `/generate` and hands a TGI body (`inputs`,
  or anything that is not SGLang's) to TGI's handler, so the path serves both dialects.
- `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/metrics` are the app's own:
  the router forwards OpenAI bodies with SGLang's extra fields set to their defaults
  (`no_stop_trim`, `separate_reasoning`, ...), which the OpenAI schemas ignore.

SGLang's `/flush_cache` is not served (the engine has no command to drop its prefix cache):
the router reports each worker's flush as failed (404).

SGLang requests take the same pipeline as the other dialects (gateway/pipeline.py): a
concurrency slot, tokenization off the event loop, TGI's length limits, the grammar
compiled before submission, the same metrics. SGLang's wire words stay in this module; its
errors take the `{"error": {"message", ...}}` shape of the OpenAI dialect, with its statuses.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import FinishReason, RequestOutput

from .auth import require_api_key
from .errors import ErrorKind, GatewayError, SafeJSONResponse, invalid
from .openai.common import served_model_names
from .openai.params import check_token_ids
from .pipeline import Pipeline, StreamRenderer, off_loop
from .service import Completion, GenerationService
from .streaming import sse_data
from .structured import check_enabled, compiled, regex_spec, schema_spec
from .tgi.body import json_object, parse
from .tgi.routes import generate_answer
from .tgi.schemas import GenerateRequest

router = APIRouter()
_AUTH = [Depends(require_api_key)]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


# -- the request ----------------------------------------------------------------------------
class SGLangSamplingParams(BaseModel):
    """`sampling_params` of SGLang's `/generate` (python/sglang/srt/sampling/sampling_params.py)."""

    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    sampling_seed: int | None = None
    n: int = Field(1, ge=1)
    json_schema: str | None = None  # the schema's JSON text
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


class SGLangGenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput`: one prompt or a batch, as text or token ids. Fields the
    router fills in with their defaults (`log_metrics`, `background`, ...) are ignored;
    those that would ask for what is not served are refused when set."""

    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool | list[bool] = False
    return_hidden_states: bool = False
    image_data: object = None
    audio_data: object = None
    lora_path: object = None


@dataclass(frozen=True)
class SGLangPlan:
    """A checked SGLang request: the prompts' ids and their one SamplingParams each."""

    rid: str
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]  # one per prompt (max_tokens fitted to it)
    batched: bool  # a list was given: the answer is a list
    stream: bool


def is_sglang_body(body: dict) -> bool:
    """SGLang's `/generate` body (`text` or `input_ids`), not TGI's (`inputs`)."""
    return "inputs" not in body and ("text" in body or "input_ids" in body)


def plan_request(req: SGLangGenerateRequest, service: GenerationService) -> SGLangPlan:
    """Tokenize and check an SGLang request (run off the event loop)."""
    _refuse_unserved(req)
    if (req.text is None) == (req.input_ids is None):
        raise invalid("give exactly one of `text` and `input_ids`", "text")
    prompts, batched = _prompts(req, service)
    if not prompts:
        raise invalid("the batch must not be empty", "text" if req.text is not None else "input_ids")
    limit = service.settings.max_client_batch_size
    if len(prompts) > limit:
        raise invalid(f"at most {limit} prompts per request. Given: {len(prompts)}", "text")
    if req.stream and batched:
        raise invalid("streaming a batch is not supported: send one prompt per streamed request", "stream")
    sp = req.sampling_params
    params = []
    for ids in prompts:
        max_tokens = service.check_lengths(len(ids), sp.max_new_tokens, "text")
        params.append(_sampling_params(sp, service, max_tokens))
    return SGLangPlan(req.rid or uuid.uuid4().hex, tuple(tuple(p) for p in prompts), tuple(params),
                      batched, req.stream)


def _refuse_unserved(req: SGLangGenerateRequest) -> None:
    wanted = {"return_logprob": req.return_logprob is True or (isinstance(req.return_logprob, list)
                                                                and any(req.return_logprob)),
              "return_hidden_states": req.return_hidden_states, "image_data": req.image_data is not None,
              "audio_data": req.audio_data is not None, "lora_path": req.lora_path is not None,
              "sampling_params.ebnf": req.sampling_params.ebnf is not None,
              "sampling_params.structural_tag": req.sampling_params.structural_tag is not None}
    for name, asked in wanted.items():
        if asked:
            raise invalid(f"`{name}` is not supported by this server", name)
    if req.sampling_params.n != 1:
        raise invalid("`n` > 1 is not supported on /generate: send the prompt n times", "sampling_params.n")


def _prompts(req: SGLangGenerateRequest, service: GenerationService) -> tuple[list[list[int]], bool]:
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [service.encode(text) for text in texts], not isinstance(req.text, str)
    ids = req.input_ids
    batched = bool(ids) and isinstance(ids[0], list)
    vocab_size = len(service.tokenizer)
    return [check_token_ids(item, vocab_size, "input_ids") for item in (ids if batched else [ids])], batched


def _sampling_params(sp: SGLangSamplingParams, service: GenerationService, max_tokens: int) -> SamplingParams:
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    if len(stop) > service.settings.max_stop_sequences:
        raise invalid(f"stop supports up to {service.settings.max_stop_sequences} sequences. "
                      f"Given: {len(stop)}", "sampling_params.stop")
    grammar = None
    if sp.json_schema is not None and sp.regex is not None:
        raise invalid("give at most one of `json_schema` and `regex`", "sampling_params.json_schema")
    if sp.json_schema is not None:
        check_enabled(service.settings, "sampling_params.json_schema")
        try:
            schema = json.loads(sp.json_schema)
        except json.JSONDecodeError as exc:
            raise invalid(f"json_schema is not valid JSON: {exc}", "sampling_params.json_schema") from exc
        grammar = schema_spec(schema, "sampling_params.json_schema")
    elif sp.regex is not None:
        check_enabled(service.settings, "sampling_params.regex")
        grammar = regex_spec(sp.regex, "sampling_params.regex")
    vocab_size = len(service.tokenizer)
    try:
        return SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, top_k=0 if sp.top_k in (-1, 0) else sp.top_k,
            min_p=sp.min_p, frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty, max_tokens=max_tokens, min_tokens=sp.min_new_tokens,
            seed=sp.sampling_seed, stop=tuple(stop),
            stop_token_ids=tuple(check_token_ids(sp.stop_token_ids or (), vocab_size,
                                                 "sampling_params.stop_token_ids")),
            ignore_eos=sp.ignore_eos, include_stop_str_in_output=sp.no_stop_trim,
            skip_special_tokens=sp.skip_special_tokens, grammar=grammar)
    except ValidationError as exc:
        raise invalid(str(exc), f"sampling_params.{exc.param}" if exc.param else None) from exc


# -- the answer -----------------------------------------------------------------------------
def finish_reason(reason: FinishReason | None, stop_token: int | None, completion_tokens: int) -> dict | None:
    """SGLang's `meta_info.finish_reason`: `{"type": "stop"|"length"|"abort", ...}`."""
    if reason is None:
        return None
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": completion_tokens}
    if reason is FinishReason.ABORT:
        return {"type": "abort", "message": "the request was aborted"}
    return {"type": "stop", "matched": stop_token}  # EOS, a stop token, a stop string, a grammar's end


def meta_info(rid: str, reason: dict | None, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
              started: float) -> dict:
    return {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "cached_tokens": cached_tokens,
            "e2e_latency": round(time.monotonic() - started, 6)}


def _answer(plan: SGLangPlan, completions: list[Completion], started: float) -> dict | list[dict]:
    items = []
    for i, done in enumerate(completions):
        rid = plan.rid if not plan.batched else f"{plan.rid}-{i}"
        eos_token = done.token_ids[-1] if done.finish_reason is FinishReason.EOS and done.token_ids else None
        stop_token = done.stop_reason if done.stop_reason is not None else eos_token
        reason = finish_reason(done.finish_reason, stop_token, len(done.token_ids))
        items.append({"text": done.text, "output_ids": list(done.token_ids),
                      "meta_info": meta_info(rid, reason, done.num_prompt_tokens, len(done.token_ids),
                                             done.num_cached_tokens, started)})
    return items if plan.batched else items[0]


class SGLangEvents(StreamRenderer):
    """SGLang's stream: one `data:` event per engine output with the text and ids so far
    (SGLang's default, not incremental), the last with its finish reason; then `[DONE]`."""

    def __init__(self, plan: SGLangPlan, started: float):
        self._plan = plan
        self._started = started
        self._text: list[str] = []
        self._ids: list[int] = []

    def on_output(self, index: int, out: RequestOutput) -> list[str]:
        self._text.append(out.new_text)
        self._ids.extend(out.new_token_ids)
        stop_token = out.stop_reason
        if out.finish_reason is FinishReason.EOS and self._ids:
            stop_token = self._ids[-1]
        reason = finish_reason(out.finish_reason if out.finished else None, stop_token, out.num_output_tokens)
        return [sse_data({"text": "".join(self._text), "output_ids": list(self._ids),
                          "meta_info": meta_info(self._plan.rid, reason, out.num_prompt_tokens,
                                                 out.num_output_tokens, out.num_cached_tokens, self._started)})]

    def on_error(self, error: GatewayError) -> list[str]:
        return [sse_data({"error": {**error.openai_body()["error"], "http_status_code": error.openai_status}})]

    def end(self) -> list[str]:
        return [sse_data("[DONE]")]


async def _sglang_generate(service: GenerationService, request: Request, body: dict) -> Response:
    started = time.monotonic()
    pipeline = Pipeline(service)

    async def prepare():
        req = parse(SGLangGenerateRequest, body)
        plan = await off_loop(plan_request, req, service)
        grammar = plan.params[0].grammar
        if grammar is not None:
            await compiled(service.client, grammar, "sampling_params")
        return plan, await service.submit_all(list(zip(plan.prompts, plan.params)))

    admission, (plan, streams) = await pipeline.start(prepare)
    if plan.stream:
        return pipeline.stream(admission, streams, SGLangEvents(plan, started), {})
    completions = await pipeline.collect(admission, streams, request)
    return SafeJSONResponse(_answer(plan, completions, started))


def render_sglang_error(exc: GatewayError | RequestValidationError) -> Response:
    """An error in SGLang's shape (`{"error": {"message", ...}}`, the OpenAI statuses)."""
    if isinstance(exc, RequestValidationError):
        first = (exc.errors() or [{}])[0]
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = first.get("msg", "invalid request body")
        exc = GatewayError(ErrorKind.VALIDATION, f"{field}: {message}" if field else message, field)
    return exc.render("openai")


# -- routes -------------------------------------------------------------------------------
def _service(request: Request) -> GenerationService:
    return request.app.state.service


@router.post("/generate", dependencies=_AUTH, include_in_schema=False)
async def generate(request: Request):
    """SGLang's `/generate` or TGI's, by the body's shape."""
    body = await json_object(request)
    service = _service(request)
    if not is_sglang_body(body):
        tgi = parse(GenerateRequest, body)
        return await generate_answer(service, request, tgi.inputs, tgi.parameters)
    try:
        return await _sglang_generate(service, request, body)
    except (GatewayError, RequestValidationError) as exc:
        return render_sglang_error(exc)


@router.get("/health_generate", dependencies=_AUTH)
async def health_generate(request: Request):
    """SGLang's deep health check: generate one token through the whole pipeline."""
    service = _service(request)
    body = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    try:
        await _sglang_generate(service, request, body)
    except (GatewayError, RequestValidationError) as exc:
        return render_sglang_error(exc)
    return Response(status_code=200)


def _server_info(request: Request) -> dict:
    service = _service(request)
    settings = service.settings
    info = service.client.info
    names = served_model_names(settings)
    return {"model_path": settings.model_id, "tokenizer_path": settings.model_id,
            "served_model_name": names[0] if names else settings.model_id, "version": settings.version,
            "max_running_requests": settings.max_concurrent_requests,
            "max_total_num_tokens": info.max_batch_total_tokens if info is not None else None,
            "context_length": service.limits.max_total_tokens if info is not None else None}


def _model_info(request: Request) -> dict:
    settings = _service(request).settings
    return {"model_path": settings.model_id, "tokenizer_path": settings.model_id, "is_generation": True}


def _load(request: Request) -> list[dict]:
    client = _service(request).client
    load, info = client.load, client.info
    if load is None or info is None:
        return [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    return [{"dp_rank": 0, "num_reqs": load.num_running + load.num_waiting, "num_waiting_reqs": load.num_waiting,
             "num_tokens": load.num_kv_blocks_used * info.block_size}]


for _path, _view in (("/server_info", _server_info), ("/get_server_info", _server_info),
                     ("/model_info", _model_info), ("/get_model_info", _model_info), ("/get_load", _load)):
    router.add_api_route(_path, _view, methods=["GET"])
