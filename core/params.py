"""Sampling parameters, validated once at the edge (vLLM's field names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ValidationError

if TYPE_CHECKING:
    from .grammar.spec import GrammarSpec

# ValidationError is defined in core/errors.py; it is raised here, and importers take it from here.
__all__ = ["MAX_REPETITION_PENALTY", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "SamplingParams", "ValidationError"]


# Sane bounds, decided once here; both dialects report a breach in their own wording.
# Below MIN_TEMPERATURE, logits / temperature overflow float32 (inf, then a NaN softmax);
# above the maxima the distribution is noise (or, for the penalty, one token is banned).
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-n of each prompt token; None = no prompt logprobs
    typical_p: float = 1.0  # locally typical sampling; 1.0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    watermark: bool = False  # Kirchenbauer et al. green-list watermark (core/execution/watermark.py)
    grammar: GrammarSpec | None = None  # constrain the output (core/grammar); None = free text

    def __post_init__(self) -> None:
        # Accept a bare string or a list for `stop` like vLLM, store a tuple.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items()))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        not_finite = _first_non_finite(self)
        if not_finite is not None:  # NaN passes no comparison and inf passes some: refuse both first
            raise ValidationError(f"{not_finite} must be a finite number", not_finite)
        checks = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be non-negative"),
            (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE, "temperature",
             f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be -1 (off), 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be positive"),
            (self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
             f"repetition_penalty must be at most {MAX_REPETITION_PENALTY:g}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "logprobs must be non-negative"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             "prompt_logprobs must be non-negative"),
            (0.0 < self.typical_p <= 1.0, "typical_p", "typical_p must be in (0, 1]"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias", "logit_bias keys must be token ids >= 0"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ValidationError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "typical_p")


def _first_non_finite(params: SamplingParams) -> str | None:
    """The name of the first float field that is NaN or infinite ("logit_bias" for its values)."""
    for name in _FLOAT_FIELDS:
        if not _finite(getattr(params, name)):
            return name
    if not _finite(*(bias for _, bias in params.logit_bias)):
        return "logit_bias"
    return None
