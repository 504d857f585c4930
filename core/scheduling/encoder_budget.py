"""The vision encoder's share of a step (core/multimodal): image embedding rows are budgeted like
prompt tokens. Each step may start encoding images worth up to the step's token budget
(SchedulerConfig.max_num_batched_tokens) in rows; a prompt chunk that would start more is cut just
before the first image past the budget, and that image waits for the next step. The first image
of a step is always taken, however large, so an image bigger than the budget still runs.

An image counts in the step whose chunk holds its placeholder's first position (it is encoded
there, then read from the encoder cache by the chunks after it)."""
from __future__ import annotations

from ..multimodal.inputs import ImageSpan


def fit_images(spans: tuple[ImageSpan, ...], start: int, num_tokens: int, rows_used: int, budget: int) -> int:
    """How many of the `num_tokens` tokens from position `start` fit the encoder budget, when
    `rows_used` rows of it are taken already in this step."""
    rows = rows_used
    for span in spans:
        if not start <= span.offset < start + num_tokens:
            continue
        if rows + span.num_embeddings > budget and rows > 0:
            return span.offset - start
        rows += span.num_embeddings
    return num_tokens


def rows_started(spans: tuple[ImageSpan, ...], start: int, num_tokens: int) -> int:
    """The encoder rows of the images whose placeholder starts in [start, start + num_tokens)."""
    return sum(s.num_embeddings for s in spans if start <= s.offset < start + num_tokens)
