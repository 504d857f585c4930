"""TGI's parameter rules (router/src/validation.rs) turned into engine requests.

Every check raises a 422 `validation` error with TGI's message before anything
reaches the engine. Deliberate differences from TGI: `top_p=1.0` and
`typical_p=1.0` are accepted (they mean "off"), and `temperature=0` means greedy
rather than a 422.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from switchyard.core.grammar import GrammarSpec
from switchyard.core.params import SamplingParams, ValidationError

from ..errors import invalid
from ..service import GenerationService
from ..settings import ServerSettings
from ..structured import check_enabled, tgi_grammar_spec
from .schemas import GenerateParameters


@dataclass(frozen=True)
class GenerationPlan:
    """A validated TGI request: what to submit and what to report."""

    inputs: str
    prompt_ids: list[int]
    params: tuple[SamplingParams, ...]  # one per sequence: best_of of them
    sampling: bool  # seeds are reported only when sampling
    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    return_full_text: bool

    @property
    def best_of(self) -> int:
        return len(self.params)

    @property
    def max_new_tokens(self) -> int:
        return self.params[0].max_tokens


def is_sampling(p: GenerateParameters) -> bool:
    """TGI samples when asked to or when a warper would change the distribution."""
    if p.temperature is not None and p.temperature == 0.0:
        return False
    return bool(p.do_sample or (p.temperature is not None and p.temperature != 1.0)
                or p.top_k is not None or (p.top_p is not None and p.top_p < 1.0)
                or (p.typical_p is not None and p.typical_p < 1.0))


def check_best_of(p: GenerateParameters, settings: ServerSettings, stream: bool) -> int:
    best_of = 1 if p.best_of is None else p.best_of
    if settings.max_best_of == 1 and best_of != 1:
        raise invalid("`best_of` != 1 is not allowed for this endpoint", "best_of")
    if not 0 < best_of <= settings.max_best_of:
        raise invalid(f"`best_of` must be > 0 and <= {settings.max_best_of}. Given: {best_of}", "best_of")
    if stream and best_of != 1:
        raise invalid("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if stream and p.decoder_input_details:
        raise invalid("`decoder_input_details` == true is not supported when streaming tokens",
                      "decoder_input_details")
    if best_of > 1 and not is_sampling(p):
        raise invalid("you must use sampling when `best_of` is > 1", "best_of")
    if best_of > 1 and p.seed is not None:
        raise invalid("`seed` must not be set when `best_of` > 1", "seed")
    return best_of


def check_sampling(p: GenerateParameters) -> None:
    if p.temperature is not None and p.temperature < 0.0:
        raise invalid("`temperature` must be strictly positive (or 0 for greedy decoding)", "temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0.0:
        raise invalid("`repetition_penalty` must be strictly positive", "repetition_penalty")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise invalid("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise invalid("`top_p` must be > 0.0 and <= 1.0", "top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p <= 1.0:
        raise invalid("`typical_p` must be > 0.0 and <= 1.0", "typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise invalid("`top_k` must be strictly positive", "top_k")


def check_limits(p: GenerateParameters, settings: ServerSettings, max_input_tokens: int) -> None:
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise invalid("`max_new_tokens` must be strictly positive", "max_new_tokens")
    if len(p.stop) > settings.max_stop_sequences:
        raise invalid(f"`stop` supports up to {settings.max_stop_sequences} stop sequences. "
                      f"Given: {len(p.stop)}", "stop")
    if any(not s for s in p.stop):
        raise invalid("`stop` sequences must not be empty", "stop")
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= settings.max_top_n_tokens:
        raise invalid(f"`top_n_tokens` must be >= 0 and <= {settings.max_top_n_tokens}. "
                      f"Given: {p.top_n_tokens}", "top_n_tokens")
    if p.truncate is not None and not 0 < p.truncate <= max_input_tokens:
        raise invalid(f"`truncate` must be strictly positive and less than {max_input_tokens}. "
                      f"Given: {p.truncate}", "truncate")


def grammar_spec(p: GenerateParameters, settings: ServerSettings) -> GrammarSpec | None:
    """`parameters.grammar` checked at the edge (the engine compiles it before submission)."""
    if p.grammar is None:
        return None
    check_enabled(settings, "grammar")
    return tgi_grammar_spec(p.grammar.type, p.grammar.value, "grammar")


def sampling_params(p: GenerateParameters, sampling: bool, max_new_tokens: int, seed: int | None,
                    decoder_input_details: bool, grammar: GrammarSpec | None = None) -> SamplingParams:
    """One engine request's parameters. Logprobs are always asked for: TGI reports
    the logprob of every token, streamed or not."""
    kwargs = dict(
        max_tokens=max_new_tokens, seed=seed, stop=tuple(p.stop), include_stop_str_in_output=True,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0, logprobs=p.top_n_tokens or 0,
        prompt_logprobs=0 if decoder_input_details else None, watermark=p.watermark, grammar=grammar)
    if sampling:
        kwargs.update(temperature=1.0 if p.temperature is None else p.temperature,
                      top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k or 0,
                      typical_p=1.0 if p.typical_p is None else p.typical_p)
    else:
        kwargs.update(temperature=0.0)
    try:
        return SamplingParams(**kwargs)
    except ValidationError as exc:
        raise invalid(str(exc), exc.param) from exc


def plan_generation(service: GenerationService, inputs: str, p: GenerateParameters, stream: bool,
                    default_return_full_text: bool = False) -> GenerationPlan:
    """Validate a TGI request in TGI's order and tokenize it; raises a 422 GatewayError."""
    settings = service.settings
    limits = service.limits
    best_of = check_best_of(p, settings, stream)
    check_sampling(p)
    check_limits(p, settings, limits.max_input_tokens)
    if not inputs:
        raise invalid("`inputs` cannot be empty", "inputs")
    grammar = grammar_spec(p, settings)
    prompt_ids = service.encode(inputs)
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate:]
    max_new_tokens = service.check_lengths(len(prompt_ids), p.max_new_tokens, "inputs")
    sampling = is_sampling(p)
    seeds: list[int | None] = [p.seed] if best_of == 1 else [None] * best_of
    if sampling:  # TGI draws the seed it reports, so every sampled answer is reproducible
        seeds = [random.getrandbits(63) if s is None else s for s in seeds]
    base = sampling_params(p, sampling, max_new_tokens, seeds[0], p.decoder_input_details, grammar)
    params = (base,) + tuple(replace(base, seed=seed) for seed in seeds[1:])  # best_of: only the seed differs
    full_text = default_return_full_text if p.return_full_text is None else p.return_full_text
    return GenerationPlan(inputs=inputs, prompt_ids=prompt_ids, params=params, sampling=sampling,
                          details=p.details or p.decoder_input_details,
                          decoder_input_details=p.decoder_input_details, top_n_tokens=p.top_n_tokens or 0,
                          return_full_text=full_text)
