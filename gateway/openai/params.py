"""OpenAI request -> what the engine is asked for, in one place.

Every field is either honoured here (mapped onto `SamplingParams`) or rejected with
a 400 naming it; none is dropped silently. Structured output (`response_format`,
vLLM's guided_* and structured_outputs: formats.py) and tools (tools.py) turn into
the `GrammarSpec` every sequence's params carry.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import sequence_seed

from ..errors import ErrorKind, invalid
from ..reasoning import ReasoningPlan
from ..settings import ServerSettings
from ..tool_parsers import ToolFormat
from .formats import output_grammar
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from .tools import ToolPlan, tool_plan

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
_MAX_SEED = 2**63 - 1  # torch's generators take any seed in [-2**63, 2**64)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's words


@dataclass(frozen=True)
class EnginePlan:
    """What one HTTP request asks of the engine, per prompt."""

    params: SamplingParams  # of one sequence (n=1); max_tokens filled in per prompt
    max_tokens: int | None  # as asked; None: the default below, else all the context left
    default_max_tokens: int | None
    num_choices: int  # n
    num_sequences: int  # generated per prompt: best_of (>= n)
    discard_output: bool = False  # completions echo with max_tokens 0: score the prompt only
    grammar_param: str | None = None  # the field that asked for params.grammar: compile errors name it
    tools: ToolPlan | None = None  # chat: tools the output may call
    reasoning: ReasoningPlan | None = None  # chat: a reasoning model's thinking, split from its answer
    images: tuple = ()  # chat: the conversation's images (core/multimodal ImageData), loaded (gateway/media)
    thinking_budget: int | None = None  # chat: thinking tokens before the end marker is forced (None: no limit)

    def reasoned(self, reasoning: ReasoningPlan | None) -> EnginePlan:
        """This plan for a reasoning model's output (gateway/reasoning): its grammar gated
        to the answer, its thinking split out."""
        if reasoning is None:
            if self.thinking_budget is not None:
                raise invalid("thinking_token_budget is not supported: this model does not reason (no reasoning "
                              "parser: see --reasoning-parser)", "thinking_token_budget")
            return self
        return replace(self, params=reasoning.engine_params(self.params, self.thinking_budget), reasoning=reasoning)

    def sequence_params(self, service, num_prompt_tokens: int, param: str) -> list[SamplingParams]:
        """The params of each sequence for a prompt of this length (lengths checked;
        each sequence its own seed, none shared with a neighbouring request seed's)."""
        if self.max_tokens is None and self.default_max_tokens is not None:
            room = service.check_lengths(num_prompt_tokens, None, param)
            max_tokens = min(self.default_max_tokens, room)
        else:
            max_tokens = service.check_lengths(num_prompt_tokens, self.max_tokens, param)
        base = replace(self.params, max_tokens=max_tokens)
        if base.seed is None:
            return [base] * self.num_sequences
        return [replace(base, seed=sequence_seed(base.seed, i)) for i in range(self.num_sequences)]


# -- chat ---------------------------------------------------------------------------------------
def chat_plan(req: ChatCompletionRequest, settings: ServerSettings, vocab_size: int,
              tool_format: ToolFormat | None = None) -> EnginePlan:
    """`tool_format`: the served model's own tool-call format (gateway/tool_parsers), if any."""
    _reject_unsupported_extras(req)
    _reject_unsupported_chat(req)
    tools = tool_plan(req, settings, tool_format)
    output = output_grammar(req, settings, req.response_format)
    grammar, grammar_param = (output.spec, output.param) if output else (None, None)
    tools_grammar = tools.grammar if tools is not None else None
    if tools_grammar is not None:
        if output is not None:
            raise invalid(f"{output.param} and {tools.param} {tools.mode!r} both constrain the output; send one",
                          tools.param, ErrorKind.TOOL)
        grammar, grammar_param = tools_grammar, tools.tools_param
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = _sampling_params(req, settings, vocab_size, max_tokens, logprobs, param, grammar=grammar)
    if tools is not None and tools.keeps_special_tokens:  # the format's markers must reach its parser
        params = replace(params, skip_special_tokens=False)
    n = req.n or 1
    budget = None if req.thinking_token_budget in (None, -1) else req.thinking_token_budget
    return EnginePlan(params, max_tokens, None, n, n, grammar_param=grammar_param, tools=tools, thinking_budget=budget)


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.reasoning_effort not in (None, *REASONING_EFFORTS):  # whether the model reasons: messages.py
        raise invalid(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {req.reasoning_effort!r}",
                      "reasoning_effort")
    if req.modalities not in (None, ["text"]):
        raise invalid("only the text modality is supported", "modalities")
    if req.store:
        raise invalid("store is not supported: completions are not kept", "store")
    unsupported = {
        "verbosity": "verbosity is not supported by this model",
        "audio": "audio output is not supported",
        "web_search_options": "web search is not supported",
        "moderation": "moderation is not supported",
        "chat_template": "a chat template from the request is not accepted",
        "documents": "documents are not supported",
    }
    for name, message in unsupported.items():
        if getattr(req, name) is not None:
            raise invalid(message, name)
    if req.echo:
        raise invalid("echo is not supported on chat completions", "echo")
    if req.continue_final_message:
        raise invalid("continue_final_message is not supported yet", "continue_final_message")


# -- completions ----------------------------------------------------------------------------------
def completion_plan(req: CompletionRequest, settings: ServerSettings, vocab_size: int) -> EnginePlan:
    _reject_unsupported_extras(req)
    if req.suffix:
        raise invalid("suffix is not supported by this model", "suffix")
    if req.prompt_logprobs is not None:
        raise invalid("prompt_logprobs is not supported; use echo with logprobs", "prompt_logprobs")
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and req.stream:
        raise invalid("best_of cannot be used with stream", "best_of")
    discard = req.max_tokens == 0
    if discard and not req.echo:
        raise invalid("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
    # best_of ranks sequences by their log-probability, so it needs them
    logprobs = req.logprobs if req.logprobs is not None else (0 if best_of > n else None)
    max_tokens = 1 if discard else req.max_tokens
    output = output_grammar(req, settings)
    params = _sampling_params(req, settings, vocab_size, max_tokens, logprobs, "max_tokens",
                              grammar=output.spec if output else None,
                              prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    return EnginePlan(params, max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, n, best_of, discard_output=discard,
                      grammar_param=output.param if output else None)


# -- shared -----------------------------------------------------------------------------------------
def _reject_unsupported_extras(req: SamplingFields) -> None:
    if req.use_beam_search:
        raise invalid("beam search is not supported", "use_beam_search")
    if req.length_penalty not in (None, 1.0):
        raise invalid("length_penalty is not supported (it applies to beam search)", "length_penalty")
    if req.allowed_token_ids:
        raise invalid("allowed_token_ids is not supported yet", "allowed_token_ids")
    if req.bad_words:
        raise invalid("bad_words is not supported yet", "bad_words")
    if not req.spaces_between_special_tokens:
        raise invalid("spaces_between_special_tokens=false is not supported", "spaces_between_special_tokens")


def _sampling_params(req: SamplingFields, settings: ServerSettings, vocab_size: int, max_tokens: int | None,
                     logprobs: int | None, max_tokens_param: str, **engine_fields) -> SamplingParams:
    """The one SamplingParams of a request's sequences (each sequence then only gets its
    max_tokens for its prompt and its own seed); `engine_fields`: grammar, prompt_logprobs."""
    temperature = _default(req.temperature, 1.0)
    top_p = _default(req.top_p, 1.0)
    if top_p == 0.0:  # nucleus of probability 0 keeps only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > settings.max_stop_sequences:
        raise invalid(f"stop supports up to {settings.max_stop_sequences} sequences. Given: {len(stop)}", "stop")
    if req.seed is not None and abs(req.seed) > _MAX_SEED:
        raise invalid(f"seed must be between {-_MAX_SEED} and {_MAX_SEED}", "seed")
    try:
        return SamplingParams(
            n=1, temperature=temperature, top_p=top_p, top_k=_default(req.top_k, 0),
            min_p=_default(req.min_p, 0.0), repetition_penalty=_default(req.repetition_penalty, 1.0),
            presence_penalty=_default(req.presence_penalty, 0.0),
            frequency_penalty=_default(req.frequency_penalty, 0.0), max_tokens=max_tokens,
            min_tokens=_default(req.min_tokens, 0), seed=req.seed, stop=tuple(stop),
            stop_token_ids=tuple(check_token_ids(req.stop_token_ids or (), vocab_size, "stop_token_ids")),
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            typical_p=_default(req.typical_p, 1.0), logit_bias=_logit_bias(req.logit_bias, vocab_size),
            **engine_fields)
    except ValidationError as exc:
        param = max_tokens_param if exc.param == "max_tokens" else exc.param
        raise invalid(str(exc), param) from exc


def _default(value, default):
    return default if value is None else value


def check_token_ids(ids, vocab_size: int, param: str) -> list[int]:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise invalid(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})", param)
    return list(ids)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids; got {key!r}", "logit_bias") from None
        check_token_ids((token_id,), vocab_size, "logit_bias")
        pairs.append((token_id, float(value)))
    return tuple(pairs)
