"""One request's reasoning, decided once its prompt is rendered: `plan_reasoning` ->
`ReasoningPlan` (or None: the model does not reason, or --reasoning-parser none), which

- changes what the engine is asked (`engine_params`): a grammar gets the format's gate, so it
  constrains the answer only (core/grammar/gate.py), and a thinking budget becomes that gate's
  budget (over a grammar of any text when the answer has none); and where a marker is a special token
  (Magistral's [THINK], harmony's), special tokens are kept in the text so the markers can be
  read, and the end-of-sequence tokens' text is dropped again from what is shown;
- splits each sequence's output into reasoning and answer: `ReasoningStream` per streamed
  sequence, `split_output` for a whole one, with the number of reasoning tokens (those the gate
  counts free: up to and including the end marker).

No wire words here: the dialects (gateway/openai/reasoning.py, gateway/anthropic/) name the
pieces."""
from __future__ import annotations

from dataclasses import dataclass, replace

from switchyard.core.grammar.gate import GrammarGate
from switchyard.core.grammar.spec import GrammarSpec
from switchyard.core.params import SamplingParams

from .formats import ReasoningFormat, Start
from .pieces import Piece, joined
from .select import reasoning_format


@dataclass(frozen=True)
class ReasoningPlan:
    format: ReasoningFormat
    start: Start  # where the output starts
    gate: GrammarGate | None  # where the thinking ends, in tokens; None: the output starts in the answer
    keep_special_tokens: bool  # a marker is a special token: keep them in the text
    drops: tuple[str, ...] = ()  # text removed from the output (end-of-sequence tokens kept for the markers)

    def engine_params(self, params: SamplingParams, budget: int | None = None) -> SamplingParams:
        """`params` for this output; `budget`: a thinking budget, enforced by the gate (over any
        text where no grammar constrains the answer)."""
        changes: dict = {}
        if self.gate is not None and budget is not None:
            grammar = params.grammar if params.grammar is not None else GrammarSpec.any_text()
            changes["grammar"] = grammar.gated(replace(self.gate, budget=budget))
        elif params.grammar is not None and self.gate is not None:
            changes["grammar"] = params.grammar.gated(self.gate)
        if self.keep_special_tokens and params.skip_special_tokens:
            changes["skip_special_tokens"] = False
        return replace(params, **changes) if changes else params


def served_format(service) -> ReasoningFormat | None:
    """The reasoning format of the model `service` serves (select.py)."""
    return reasoning_format(service.settings.reasoning_parser, getattr(service.tokenizer, "chat_template", None))


def plan_reasoning(service, prompt_text: str, params: SamplingParams,
                   skip_special_tokens: bool = True) -> ReasoningPlan | None:
    """The reasoning of a chat request whose rendered prompt is `prompt_text`, whose engine
    params are `params` so far and whose client asked `skip_special_tokens`."""
    fmt = served_format(service)
    if fmt is None:
        return None
    tokenizer = service.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    start = fmt.start_of(prompt_text)
    keep = params.skip_special_tokens and any(
        marker not in tokenizer.decode(encode(marker), skip_special_tokens=True) for marker in fmt.markers)
    drops: tuple[str, ...] = ()
    if skip_special_tokens and (keep or not params.skip_special_tokens):
        # kept for a parser's sake (this one's, or a tool-call parser's), not the client's: what
        # skipping special tokens would have hidden at the output's end
        info = service.client.info
        ends = (*(info.eos_token_ids if info is not None else ()), *params.stop_token_ids)
        drops = tuple(dict.fromkeys(text for text in (tokenizer.decode([i]) for i in ends) if text))
    return ReasoningPlan(fmt, start, fmt.gate(start, encode), keep, drops)


@dataclass(frozen=True)
class Split:
    """A whole output, split."""

    reasoning: str | None  # None: the model did not think (or no reasoning parser)
    content: str
    num_reasoning_tokens: int


class ReasoningStream:
    """One sequence's output as it streams: `feed` each output's text and token ids, then
    `finish`; each returns pieces in output order. With no plan, all of it is content."""

    def __init__(self, plan: ReasoningPlan | None):
        self._splitter = plan.format.splitter(plan.start, plan.drops) if plan is not None else None
        self._gate = plan.gate if plan is not None else None
        self._gate_state = self._gate.start() if self._gate is not None else None
        self.num_reasoning_tokens = 0

    def feed(self, text: str, token_ids=()) -> list[Piece]:
        self._count(token_ids)
        if self._splitter is None:
            return [("content", text)] if text else []
        return self._splitter.feed(text) if text else []

    def finish(self) -> list[Piece]:
        return self._splitter.finish() if self._splitter is not None else []

    def _count(self, token_ids) -> None:
        for token_id in token_ids:
            if self._gate_state is None or self._gate_state.phase == "constrained":
                return
            self._gate_state, free = self._gate.step(self._gate_state, token_id)
            self.num_reasoning_tokens += free


def split_output(plan: ReasoningPlan | None, text: str, token_ids=()) -> Split:
    stream = ReasoningStream(plan)
    reasoning, content = joined(stream.feed(text, token_ids) + stream.finish())
    return Split(reasoning, content, stream.num_reasoning_tokens)
