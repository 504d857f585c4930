"""Earlier assistant turns as the chat template gets them: their thinking apart from their
answer, so that the template decides what to show of it.

A turn's thinking comes back as its own field (chat's `reasoning_content` / `reasoning`, an
Anthropic `thinking` block, a Responses `reasoning` item) or, from a client that kept the raw
text, inside its content (`<think>...</think>answer`). Either way it reaches the template as
`reasoning_content` (core/text/chat_template.py also offers it as `thinking`), and the content
holds the answer alone: Qwen3's template shows the thinking of the turns after the last user
message and drops the rest, gpt-oss's keeps it for tool-calling turns, and a template that
reads no such field (DeepSeek-R1's, which wants it removed) drops it."""
from __future__ import annotations

from .formats import ReasoningFormat
from .pieces import joined


def separated(fmt: ReasoningFormat | None, messages: list[dict]) -> list[dict]:
    """`messages` (template messages) with each assistant turn's thinking moved out of its content."""
    if fmt is None:
        return messages
    return [_separated(fmt, m) if m.get("role") == "assistant" and m.get("content") else m for m in messages]


def _separated(fmt: ReasoningFormat, message: dict) -> dict:
    splitter = fmt.splitter("maybe")
    reasoning, content = joined(splitter.feed(message["content"]) + splitter.finish())
    if reasoning is None:
        return message
    earlier = message.get("reasoning_content")
    return {**message, "content": content, "reasoning_content": f"{earlier}\n{reasoning}" if earlier else reasoning}
