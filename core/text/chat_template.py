"""Chat templates: the one place a conversation becomes prompt text.

A tokenizer brings its own template (`tokenizer.chat_template`); `--chat-template`
(serve) or `LLM(chat_template=...)` gives one for a model without one, or replaces
it. A model with neither cannot chat: that is a `ChatTemplateError` naming the way
out, never a guess at a format.

The template is rendered here, as TGI's router renders it (minijinja) rather than through
transformers: the gateway then holds a bare `tokenizers` tokenizer and never imports
transformers (core/text/serving_tokenizer.py). The environment is the one Hub templates are written
for, transformers' `apply_chat_template`: a sandbox with trim_blocks and lstrip_blocks, loop
controls, `{% generation %}` blocks, a `tojson` that keeps non-ASCII text, `raise_exception`,
`strftime_now`, and the tokenizer's special tokens (`bos_token`...) as variables. Messages
lose their None-valued keys, and a reasoning text is offered under each name templates read
(`reasoning_content`, `thinking`), as transformers does; tests/core/test_serving_tokenizer.py
checks the prompts against transformers'."""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime

from ..params import ValidationError


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
    """`messages` rendered by the tokenizer's chat template, as prompt text. `template_kwargs`
    (e.g. `tools`, a request's chat_template_kwargs) are the template's variables, over the
    tokenizer's special tokens."""
    template = _template_text(getattr(tokenizer, "chat_template", None), template_kwargs.get("tools"))
    if not template:
        raise ChatTemplateError("this model has no chat template, so it cannot answer chat messages: "
                                "use /v1/completions or /generate with a prompt, or give a template "
                                "(serve --chat-template FILE, LLM(chat_template=...))", "messages")
    variables = {**getattr(tokenizer, "special_tokens_map", {}), **template_kwargs}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return compiled_template(template).render(messages=[_template_message(m) for m in messages],
                                                  add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all are the conversation's fault
        raise ChatTemplateError(f"the chat template failed: {exc}", "messages") from exc


def sample_turn(tokenizer, content: str) -> str | None:
    """One user message `content` rendered as a chat prompt, or None where the tokenizer has no
    template or the template refuses it. A start-up renders one (core/engine/loop.py warm_up, the
    engine client on Ready): the template is then compiled in each process, and its head (a
    default system prompt, which every request without one of its own shares) is computed and held
    in the prefix cache before the first request, as the tenth finds it."""
    try:
        return render_chat(tokenizer, [{"role": "user", "content": content}])
    except ChatTemplateError:
        return None


def _template_text(template: str | dict | None, tools: list | None) -> str | None:
    """A tokenizer with several named templates: "tool_use" when tools are given, else "default"."""
    if not isinstance(template, dict):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ChatTemplateError(f"this model has several chat templates ({', '.join(sorted(template))}) and none is "
                            "the default: give one with serve --chat-template FILE", "messages")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict) -> dict:
    """A copy without None values; a reasoning text also as `thinking` and `reasoning_content`."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


@functools.lru_cache(maxsize=32)
def compiled_template(template: str):
    """The template compiled once in the sandboxed environment Hub templates are written for."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens
        with it); its body renders as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() without underscore-prefixed attributes (no path to Python's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attributes = dict(*args, **kwargs)
            for name in attributes:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=Namespace)
    return env.from_string(template)


class _TemplateDict:
    """`dict(...)` in a template, with nothing else of the type reachable."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)
