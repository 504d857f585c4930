"""Engine outputs as Anthropic's Messages API shows them: a `message` whose `content`
is a `thinking` block (a reasoning model's thinking; its `signature` is empty: nothing is
signed here), then `text` and `tool_use` blocks, with its `stop_reason` and `usage`.

The tool machinery is the chat route's (tool_output.py): a chat message, or chat
stream deltas, are read and re-shaped into content blocks here, so a call is
recognised the same way on every route. Ids are Anthropic's (`msg_...`, `toolu_...`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from switchyard.core.scheduling.request import FinishReason

from ..openai.reasoning import reasoning_of


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: FinishReason | None, tool_use: bool, context_bound: bool) -> str:
    """Anthropic's word for how the message ended, decided here only. Cut off by the length
    limit: `max_tokens`, or `model_context_window_exceeded` when the limit was the context's
    room (max_tokens asked for more than the prompt left; Anthropic's word since Sonnet 4.5),
    even inside a tool call; else `tool_use` when the message holds a call, `stop_sequence`
    when one of `stop_sequences` ended it, `end_turn` for every other natural end."""
    if finish is FinishReason.LENGTH:
        return "model_context_window_exceeded" if context_bound else "max_tokens"
    if tool_use:
        return "tool_use"
    if finish is FinishReason.STOP_STRING:
        return "stop_sequence"
    return "end_turn"


def matched_stop_sequence(stop_sequences: list[str], token_ids, tokenizer) -> str | None:
    """Which of `stop_sequences` ended the output (whose text stops before it): the one found
    first in the decoded tokens (they run through the stop sequence), the earlier listed on a
    tie, as the engine's detokenizer chooses."""
    if len(stop_sequences) == 1:
        return stop_sequences[0]
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    found = [(text.find(stop), i) for i, stop in enumerate(stop_sequences) if stop in text]
    return stop_sequences[min(found)[1]] if found else None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens *not* read from the (prefix)
    cache, `cache_read_input_tokens` those that were; their sum is the prompt's length, what
    count_tokens answers. Nothing is written to a cache on request."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(name: str, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": new_id("toolu"), "name": name, "input": tool_input}


def tool_input(arguments: str) -> dict:
    """A call's arguments (JSON text of an object) as the block's `input`; `{}` when they
    are not a whole object (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict) -> list[dict]:
    """A chat message (openai/reasoning.reasoned_message) as content blocks: its thinking and
    its text, if any, then a tool_use block per call."""
    thinking = reasoning_of(message)
    blocks = [thinking_block(thinking)] if thinking else []
    blocks += [text_block(message["content"])] if message.get("content") else []
    return blocks + [tool_use_block(call["function"]["name"], tool_input(call["function"]["arguments"]))
                     for call in message.get("tool_calls") or ()]


@dataclass
class MessageFrame:
    """What every state of one message carries: its id and model."""

    model: str
    id: str = field(default_factory=lambda: new_id("msg"))

    def body(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}
