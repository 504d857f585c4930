"""Chat templates: the one place a conversation becomes prompt text.

A tokenizer brings its own template (`tokenizer.chat_template`); `--chat-template`
(serve) or `LLM(chat_template=...)` gives one for a model without one, or replaces
it. A model with neither cannot chat: that is a `ChatTemplateError` naming the way
out, never a guess at a format."""
from __future__ import annotations

import os

from .params import ValidationError


class ChatTemplateError(ValidationError):
    """The conversation cannot be rendered: no template, or the template failed."""


def read_chat_template(template: str) -> str:
    """The template text of `template`: a path to a Jinja file, or the template itself
    (anything with a Jinja tag in it). A path that does not exist is an error."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise ChatTemplateError(f"chat template {template!r} is neither a file nor a Jinja template",
                            "chat_template")


def apply_chat_template(tokenizer, template: str | None) -> None:
    """Install `template` (path or text; None keeps the tokenizer's own) on the tokenizer."""
    if template is not None:
        tokenizer.chat_template = read_chat_template(template)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
    """`messages` rendered by the tokenizer's chat template, as prompt text."""
    if not has_chat_template(tokenizer):
        raise ChatTemplateError("this model has no chat template, so it cannot answer chat messages: "
                                "use /v1/completions or /generate with a prompt, or give a template "
                                "(serve --chat-template FILE, LLM(chat_template=...))", "messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **template_kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all are the conversation's fault
        raise ChatTemplateError(f"the chat template failed: {exc}", "messages") from exc
