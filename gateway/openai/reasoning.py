"""A reasoning model's thinking in OpenAI's chat words (gateway/reasoning splits it out):
`message.reasoning_content` and `message.reasoning` (vLLM's names, old and new; both carry
the same text, null when the model did not think), streamed as `delta.reasoning_content` /
`delta.reasoning` before the answer's deltas; `usage.completion_tokens_details.reasoning_tokens`.

The answer goes on to tool_output.py as before, so tool calls are read from the answer only.
The Responses API and Anthropic's Messages API re-shape these messages and deltas (a delta
with `reasoning_content` is thinking). Without a reasoning plan nothing changes: no fields,
deltas exactly as tool_output.py writes them."""
from __future__ import annotations

from ..reasoning import ReasoningPlan, ReasoningStream, split_output
from .tool_output import ChoiceDeltas, assistant_message
from .tools import ToolPlan

REASONING_KEYS = ("reasoning_content", "reasoning")


def reasoning_fields(text: str | None) -> dict:
    return dict.fromkeys(REASONING_KEYS, text)


def reasoning_of(delta_or_message: dict) -> str | None:
    return delta_or_message.get(REASONING_KEYS[0])


def reasoned_message(plan: ReasoningPlan | None, text: str, token_ids, finish_reason: str,
                     tools: ToolPlan | None) -> tuple[dict, str, int]:
    """A whole choice's message (its answer read by tool_output.assistant_message, its thinking
    beside it), its finish_reason, and its number of reasoning tokens."""
    split = split_output(plan, text, token_ids)
    message, finish_reason = assistant_message(split.content, finish_reason, tools)
    if plan is not None:
        message.update(reasoning_fields(split.reasoning))
    return message, finish_reason, split.num_reasoning_tokens


class ReasonedDeltas:
    """One streamed choice: `feed` each engine output's text, token ids and logprob entries,
    then `finish`; each returns (delta, logprob entries) pairs: thinking deltas, then
    ChoiceDeltas' answer and tool-call deltas. An output's log-probabilities go with the last
    delta it produced (with the next one, if it produced none: a marker held back; those of
    text that is never shown, such as whitespace around the thinking, are not sent)."""

    def __init__(self, plan: ReasoningPlan | None, tools: ToolPlan | None):
        self._plan = plan
        self._reasoning = ReasoningStream(plan)
        self._choice = ChoiceDeltas(tools)
        self._logprobs: list | None = None  # entries not sent yet

    @property
    def num_reasoning_tokens(self) -> int:
        return self._reasoning.num_reasoning_tokens

    def feed(self, text: str, token_ids, logprobs: list | None) -> list[tuple[dict, list | None]]:
        if self._plan is None:
            return self._choice.feed(text, logprobs)
        return self._deltas(self._reasoning.feed(text, token_ids), logprobs)

    def finish(self, finish_reason: str) -> tuple[list[tuple[dict, list | None]], str]:
        if self._plan is None:
            return self._choice.finish(finish_reason)
        deltas = self._deltas(self._reasoning.finish(), None, last=False)
        last, finish_reason = self._choice.finish(finish_reason)
        return self._with_logprobs(deltas + last), finish_reason

    def _deltas(self, pieces, logprobs: list | None, last: bool = True) -> list[tuple[dict, list | None]]:
        if logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(logprobs)
        deltas: list[tuple[dict, list | None]] = []
        for kind, text in pieces:
            if kind == "reasoning":
                deltas.append((reasoning_fields(text), None))
            else:
                deltas += self._choice.feed(text, None)
        return self._with_logprobs(deltas) if last else deltas

    def _with_logprobs(self, deltas: list) -> list[tuple[dict, list | None]]:
        if self._logprobs is None or not deltas:
            return deltas
        deltas[-1] = (deltas[-1][0], self._logprobs)
        self._logprobs = None
        return deltas
