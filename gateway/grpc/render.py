"""Engine outputs as TGIS's `GenerationResponse` messages: token details, stop reasons,
the stop sequence met, and the streamed shape (a first message with the input's token
count and details, then one message per engine output, the last with the stop reason).

Token texts are the tokenizer's own token strings (`convert_ids_to_tokens`, e.g. "Ġthe"),
as TGIS and vllm-tgis-adapter return them. A token's rank is known when it is among the
alternatives the engine reported (at least --max-top-n-tokens of them); beyond those it is 0."""
from __future__ import annotations

import math

from switchyard.core.scheduling.request import FinishReason, RequestOutput

from .params import GrpcPlan, ResponseOptions
from .proto import generation_pb2 as pb

_STOP_REASONS = {FinishReason.EOS: pb.EOS_TOKEN, FinishReason.STOP_TOKEN: pb.EOS_TOKEN,
                 FinishReason.GRAMMAR: pb.EOS_TOKEN,  # a complete grammar ends like EOS
                 FinishReason.STOP_STRING: pb.STOP_SEQUENCE, FinishReason.ABORT: pb.CANCELLED}


class TokenDetails:
    """TokenInfo messages of one request, by its response options."""

    def __init__(self, tokenizer, options: ResponseOptions):
        self._tokenizer = tokenizer
        self._options = options

    def _text(self, token_id: int) -> str:
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def token(self, token_id: int, logprob: float | None, alternatives) -> pb.TokenInfo:
        options = self._options
        info = pb.TokenInfo(text=self._text(token_id))
        if options.token_logprobs:
            info.logprob = math.nan if logprob is None else logprob
        if options.token_ranks:
            info.rank = _rank(token_id, logprob, alternatives)
        for alt_id, alt_logprob in (alternatives or ())[:options.top_n_tokens]:
            info.top_tokens.add(text=self._text(alt_id), logprob=alt_logprob)
        return info

    def generated(self, out: RequestOutput) -> list[pb.TokenInfo]:
        if not self._options.generated_tokens:
            return []
        return [self.token(token_id,
                           out.logprobs[i] if out.logprobs is not None and i < len(out.logprobs) else None,
                           out.top_logprobs[i] if out.top_logprobs is not None and i < len(out.top_logprobs) else ())
                for i, token_id in enumerate(out.new_token_ids)]

    def inputs(self, plan: GrpcPlan, out: RequestOutput | None) -> list[pb.TokenInfo]:
        """The prompt's tokens (the first has no logprob: NaN)."""
        if not self._options.input_tokens:
            return []
        entries = out.prompt_logprobs if out is not None and out.prompt_logprobs is not None else None
        if entries is None:
            return [self.token(token_id, None, ()) for token_id in plan.prompt_ids]
        return [self.token(token_id, logprob, top) for token_id, logprob, top in entries]


def _rank(token_id: int, logprob: float | None, alternatives) -> int:
    """1 + how many alternatives are likelier; 0 when the token is not among them."""
    if logprob is None or not any(alt_id == token_id for alt_id, _ in alternatives or ()):
        return 0
    return 1 + sum(1 for alt_id, alt_logprob in alternatives if alt_id != token_id and alt_logprob > logprob)


def stop_reason(plan: GrpcPlan, last: RequestOutput, time_limited: bool = False) -> int:
    if time_limited:
        return pb.TIME_LIMIT
    if last.finish_reason is FinishReason.LENGTH:
        at_limit = last.num_prompt_tokens + last.num_output_tokens >= plan.max_total_tokens
        return pb.TOKEN_LIMIT if at_limit and last.num_output_tokens < plan.params.max_tokens else pb.MAX_TOKENS
    return _STOP_REASONS.get(last.finish_reason, pb.NOT_FINISHED)


def stop_sequence(plan: GrpcPlan, text: str, decoded: str) -> str:
    """Which stop sequence ended the text: the one it ends with (kept in the output), or the
    one the full decode of the generated tokens goes on with (cut from it)."""
    rest = decoded[len(text):] if decoded.startswith(text) else ""
    for stop in sorted(plan.stop_sequences, key=len, reverse=True):
        if (plan.params.include_stop_str_in_output and text.endswith(stop)) or rest.startswith(stop):
            return stop
    return ""


class ResponseBuilder:
    """Accumulates one request's outputs and writes its GenerationResponse messages."""

    def __init__(self, tokenizer, plan: GrpcPlan):
        self._tokenizer = tokenizer
        self.plan = plan
        self.details = TokenDetails(tokenizer, plan.options)
        self.first: RequestOutput | None = None
        self.last: RequestOutput | None = None
        self._pieces: list[str] = []
        self._token_ids: list[int] = []
        self._tokens: list[pb.TokenInfo] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, out: RequestOutput) -> list[pb.TokenInfo]:
        if self.first is None:
            self.first = out
        self.last = out
        self._pieces.append(out.new_text)
        self._token_ids.extend(out.new_token_ids)
        tokens = self.details.generated(out)
        self._tokens.extend(tokens)
        return tokens

    def _finish(self, response: pb.GenerationResponse, time_limited: bool) -> None:
        """The stop reason, stop sequence and seed of a finished (or time-limited) request."""
        plan = self.plan
        if self.last is None:
            response.stop_reason = pb.TIME_LIMIT if time_limited else pb.NOT_FINISHED
            return
        response.stop_reason = stop_reason(plan, self.last, time_limited)
        if response.stop_reason == pb.STOP_SEQUENCE:
            decoded = self._tokenizer.decode(self._token_ids, skip_special_tokens=plan.params.skip_special_tokens)
            response.stop_sequence = stop_sequence(plan, self.text, decoded)
        if plan.sampling:
            response.seed = plan.params.seed

    def whole(self, time_limited: bool = False) -> pb.GenerationResponse:
        """Generate's answer for this prompt."""
        plan = self.plan
        response = pb.GenerationResponse(
            input_token_count=len(plan.prompt_ids), generated_token_count=len(self._token_ids),
            text=(plan.text if plan.options.input_text else "") + self.text, tokens=self._tokens,
            input_tokens=self.details.inputs(plan, self.first))
        self._finish(response, time_limited)
        return response

    def head(self, first: RequestOutput | None) -> pb.GenerationResponse:
        """GenerateStream's first message: the input's token count (and text, and tokens)."""
        plan = self.plan
        return pb.GenerationResponse(input_token_count=len(plan.prompt_ids),
                                     text=plan.text if plan.options.input_text else "",
                                     input_tokens=self.details.inputs(plan, first))

    def step(self, out: RequestOutput, tokens: list[pb.TokenInfo]) -> pb.GenerationResponse:
        """GenerateStream's message of one engine output (the output already `add`ed)."""
        response = pb.GenerationResponse(generated_token_count=len(self._token_ids), text=out.new_text,
                                         tokens=tokens)
        if out.finished:
            self._finish(response, False)
        return response

    def time_limit(self) -> pb.GenerationResponse:
        """GenerateStream's last message when time_limit_millis ran out."""
        response = pb.GenerationResponse(generated_token_count=len(self._token_ids))
        self._finish(response, True)
        return response
