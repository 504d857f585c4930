"""Image tokens that attend to each other both ways (Gemma 3: `CausalLM.bidirectional_images`),
within the backends' causal attention contract.

A decode row (one query token) attends to the first `seq_len` keys of its request, and every key
of a step is written before any row attends (core/execution/runner.py build_step_input). So a
chunk that holds image tokens is laid out as decode rows, and the row of an image token (a
position of its span's `embed_offsets`, one run) gets seq_len = the position of the image's last
token + 1 instead of its own + 1: it sees every key before it, and the rest of its image. The
scheduler never ends a chunk inside that run (core/scheduling/encoder_budget.py), so those keys
are in the cache or in the step; a prefix-cache hit that ends inside the run leaves keys computed
with the whole image, and the rest of the run is one chunk.

In a sliding-window layer a row's window is counted back from its seq_len: exact while the image
ends inside the first sliding_window positions; past that, an image token's row misses the keys
(last - position) at the far end of its window that transformers' mask keeps."""
from __future__ import annotations

from ..scheduling.output import ScheduledRequest


def image_rows(s: ScheduledRequest) -> bool:
    """Whether a chunk is laid out as decode rows for its images' sake (it touches an image)."""
    return bool(s.images)


def row_seq_lens(s: ScheduledRequest) -> list[int]:
    """The seq_len of each row of the chunk: its position + 1, an image token's the position of its
    image's last token + 1 (that token is in the chunk: the scheduler keeps an image's run whole)."""
    start, n = s.num_computed_tokens, len(s.token_ids)
    lens = list(range(start + 1, start + n + 1))
    for span in s.images:
        first, last = span.image_run
        if first >= start + n or last < start:
            continue
        if last >= start + n:
            raise ValueError(f"a chunk of positions [{start}, {start + n}) ends inside an image's tokens "
                             f"[{first}, {last}]")
        for position in range(max(first, start), last + 1):
            lens[position - start] = last + 1
    return lens
