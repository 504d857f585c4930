"""Engine outputs in TGI's shapes: tokens, top tokens, prefill, details, stream
events and the x-* headers (router/src/lib.rs, server.rs)."""
from __future__ import annotations

from switchyard.core.scheduling.request import FinishReason, RequestOutput

from ..errors import ErrorKind, GatewayError
from ..service import Timings
from ..tokens import token_strings
from .validation import GenerationPlan

_FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "eos_token",
                   FinishReason.STOP_TOKEN: "eos_token", FinishReason.STOP_STRING: "stop_sequence",
                   FinishReason.GRAMMAR: "eos_token"}  # a complete grammar ends like EOS


def finish_reason_name(reason: FinishReason | None) -> str:
    """TGI's word for how a sequence ended; an engine-side abort is an incomplete generation."""
    name = _FINISH_REASONS.get(reason)
    if name is None:
        raise GatewayError(ErrorKind.INCOMPLETE, "Incomplete generation")
    return name


class Vocab:
    """Token texts as TGI shows them: one token decoded alone, special tokens included."""

    def __init__(self, tokenizer):
        self._strings = token_strings(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def text(self, token_id: int) -> str:
        return self._strings.text(token_id)

    def token(self, token_id: int, logprob: float | None, text: str | None = None) -> dict:
        special = token_id in self.special_ids
        if text is None or special:
            text = self.text(token_id)
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def top_tokens(self, alternatives) -> list[dict]:
        return [self.token(token_id, logprob) for token_id, logprob in alternatives or ()]

    def prefill(self, prompt_ids: list[int], prompt_logprobs) -> list[dict]:
        """`decoder_input_details`: every prompt token, the first without a logprob."""
        if prompt_logprobs is None:
            return [{"id": t, "text": self.text(t), "logprob": None} for t in prompt_ids]
        return [{"id": entry[0], "text": self.text(entry[0]), "logprob": entry[1]} for entry in prompt_logprobs]


def vocab_for(tokenizer) -> Vocab:
    """Cheap: the token texts are cached per tokenizer in gateway/tokens.py."""
    return Vocab(tokenizer)


class Sequence:
    """One generated sequence, accumulated output by output."""

    def __init__(self, vocab: Vocab, seed: int | None):
        self.vocab = vocab
        self.seed = seed
        self.tokens: list[dict] = []
        self.top_tokens: list[list[dict]] = []
        self._text: list[str] = []
        self.prompt_logprobs = None
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> list[tuple[dict, list[dict]]]:
        """Take one output; returns its (token, top tokens) pairs. The output's text
        delta goes on its last token, so the token texts add up to the text."""
        if self.last is None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out
        self._text.append(out.new_text)
        pairs = []
        count = len(out.new_token_ids)
        for i, token_id in enumerate(out.new_token_ids):
            logprob = out.logprobs[i] if out.logprobs is not None and i < len(out.logprobs) else None
            top = out.top_logprobs[i] if out.top_logprobs is not None and i < len(out.top_logprobs) else ()
            text = out.new_text if i == count - 1 else ""
            pair = (self.vocab.token(token_id, logprob, text), self.vocab.top_tokens(top))
            self.tokens.append(pair[0])
            self.top_tokens.append(pair[1])
            pairs.append(pair)
        return pairs

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def cumulative_logprob(self) -> float:
        return sum(t["logprob"] for t in self.tokens if t["logprob"] is not None)

    def details(self, plan: GenerationPlan, text_prefix: str = "") -> dict:
        """TGI's `details` (and, with `generated_text`, a `best_of_sequences` entry)."""
        details = {
            "finish_reason": finish_reason_name(self.last.finish_reason if self.last else None),
            "generated_tokens": len(self.tokens),
            "seed": self.seed if plan.sampling else None,
            "prefill": (self.vocab.prefill(plan.prompt_ids, self.prompt_logprobs)
                        if plan.decoder_input_details else []),
            "tokens": self.tokens,
        }
        if plan.top_n_tokens:
            details["top_tokens"] = self.top_tokens
        return details


def generate_response(plan: GenerationPlan, sequences: list[Sequence]) -> dict:
    """The /generate body: the sequence with the highest cumulative logprob, the
    others in `best_of_sequences` when best_of > 1."""
    prefix = plan.inputs if plan.return_full_text else ""
    best = max(sequences, key=lambda s: s.cumulative_logprob)
    body: dict = {"generated_text": prefix + best.text}
    if plan.details:
        details = best.details(plan)
        if len(sequences) > 1:
            details["best_of_sequences"] = [
                {"generated_text": prefix + s.text, **s.details(plan)} for s in sequences if s is not best]
        body["details"] = details
    else:
        finish_reason_name(best.last.finish_reason if best.last else None)  # an abort is still an error
    return body


def stream_event(index: int, token: dict, top_tokens: list[dict], plan: GenerationPlan,
                 sequence: Sequence | None = None) -> dict:
    """One `data:` event; the last one (`sequence` given) carries the text and details."""
    event: dict = {"index": index, "token": token}
    if top_tokens:
        event["top_tokens"] = top_tokens
    event["generated_text"] = None
    event["details"] = None
    if sequence is not None:
        prefix = plan.inputs if plan.return_full_text else ""
        reason = finish_reason_name(sequence.last.finish_reason)
        event["generated_text"] = prefix + sequence.text
        if plan.details:
            event["details"] = {"finish_reason": reason, "generated_tokens": len(sequence.tokens),
                                "seed": sequence.seed if plan.sampling else None,
                                "input_length": len(plan.prompt_ids)}
    return event


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def timing_headers(timings: Timings, plan: GenerationPlan, generated_tokens: int, compute_type: str) -> dict:
    """TGI's x-* headers of a non-streamed answer: x-compute-time in seconds, the rest in ms."""
    per_token = timings.inference / max(1, generated_tokens)
    return {
        "x-compute-type": compute_type,
        "x-compute-time": repr(round(timings.total, 6)),
        "x-compute-characters": str(len(plan.inputs)),
        "x-total-time": _ms(timings.total),
        "x-validation-time": _ms(timings.validation),
        "x-queue-time": _ms(timings.queue),
        "x-inference-time": _ms(timings.inference),
        "x-time-per-token": _ms(per_token),
        "x-prompt-tokens": str(len(plan.prompt_ids)),
        "x-generated-tokens": str(generated_tokens),
    }
