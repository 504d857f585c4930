"""`--reasoning-parser`'s value -> the served model's `ReasoningFormat`, or None (no splitting).

`auto` (the default) reads the model's chat template and takes the format whose sign it
bears (formats.py) when exactly one does; a template with none is a model that does not
reason, one with several is left alone (logged: name the parser). `none` turns it off.
vLLM's and SGLang's spellings are accepted (`deepseek-r1`, `openai_gptoss`, `gpt-oss`)."""
from __future__ import annotations

import functools
import logging

from switchyard.core.params import ValidationError

from .formats import FORMATS, ReasoningFormat

logger = logging.getLogger("switchyard.gateway.reasoning")

AUTO, NONE = "auto", "none"
CHOICES = (AUTO, NONE, *FORMATS)
_ALIASES = {"openai_gptoss": "gpt_oss", "gptoss": "gpt_oss", "deepseek": "deepseek_r1", "magistral": "mistral"}


def parser_name(value: str) -> str:
    """The canonical name of a `--reasoning-parser` value; ValidationError for an unknown one."""
    name = value.strip().lower().replace("-", "_")
    name = _ALIASES.get(name, name)
    if name not in CHOICES:
        raise ValidationError(f"--reasoning-parser must be one of {', '.join(CHOICES)}; got {value!r}")
    return name


def reasoning_format(setting: str, template) -> ReasoningFormat | None:
    """The format a model with chat template `template` (text, a dict of named templates, or
    None) is served with under `--reasoning-parser setting`."""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    return _resolved(setting, template or "")


@functools.lru_cache(maxsize=32)
def _resolved(setting: str, template: str) -> ReasoningFormat | None:
    if setting == NONE:
        return None
    if setting != AUTO:
        return FORMATS[setting]
    signed = [f for f in FORMATS.values() if f.sign(template)]
    if len(signed) > 1:
        logger.warning("the chat template bears the signs of several reasoning formats (%s): none is used; "
                       "choose one with --reasoning-parser", ", ".join(f.name for f in signed))
        return None
    if signed:
        logger.info("reasoning parser: %s (from the chat template)", signed[0].name)
        return signed[0]
    return None
