"""The vision encoder's share of a step (core/multimodal): image embedding rows are budgeted like
prompt tokens. Each step may start encoding images worth up to the step's token budget
(SchedulerConfig.max_num_batched_tokens) in rows; a prompt chunk that would start more is cut just
before the first image past the budget, and that image waits for the next step. The first image
of a step is always taken, however large, so an image bigger than the budget still runs.

An image counts in the step whose chunk holds its placeholder's first position (it is encoded
there, then read from the encoder cache by the chunks after it).

With whole images (SchedulerConfig.whole_images: a model whose image tokens attend to each other
both ways, core/multimodal/image_rows.py) a chunk also never ends inside an image's run of image
tokens (its span's embed_offsets): it stops before the run, or, where it starts at the run (or
inside it, after a prefix-cache hit), it takes the rest of the run whole if that image is the
step's first, past the step's token budget if need be (so an image larger than the budget still
runs), and else none of it (the next step)."""
from __future__ import annotations

from ..multimodal.inputs import ImageSpan


def fit_images(spans: tuple[ImageSpan, ...], start: int, num_tokens: int, rows_used: int, budget: int,
               whole: bool = False) -> int:
    """How many of the `num_tokens` tokens from position `start` fit the encoder budget, when
    `rows_used` rows of it are taken already in this step; with `whole`, the count that ends no
    chunk inside an image's run of image tokens (more than num_tokens for a step's first image
    that the chunk starts at and that does not fit it)."""
    rows = rows_used
    stop = start + num_tokens
    for span in spans:
        if start <= span.offset < stop:
            if rows + span.num_embeddings > budget and rows > 0:
                return span.offset - start
            rows += span.num_embeddings
        if whole:
            first, last = span.image_run
            if first < stop <= last:  # it would end inside the run
                if first > start:
                    return first - start
                return last + 1 - start if rows_used == 0 else 0
    return num_tokens


def stop_outside_images(spans: tuple[ImageSpan, ...], start: int, num_tokens: int) -> int:
    """At most `num_tokens` tokens from `start`, cut back so that the chunk does not end inside an
    image's run of image tokens (0 where it starts inside one): where whole images must fit the
    KV room a chunk got (Scheduler._make_room)."""
    stop = start + num_tokens
    for span in spans:
        first, last = span.image_run
        if first < stop <= last:
            return max(first - start, 0)
    return num_tokens


def rows_started(spans: tuple[ImageSpan, ...], start: int, num_tokens: int) -> int:
    """The encoder rows of the images whose placeholder starts in [start, start + num_tokens)."""
    return sum(s.num_embeddings for s in spans if start <= s.offset < start + num_tokens)
