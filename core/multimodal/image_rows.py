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

In a sliding-window layer (window W) transformers' mask gives the image token at position p the
keys [p - W + 1, p] and the rest of its image. A backend that declares Capabilities.window_anchors
gets each row's anchor, the position its window counts back from (AttentionMetadata.window_anchors:
the row's own position), so the row sees keys [p - W + 1, last]: exact. Elsewhere the window counts
back from seq_len - 1: exact while the image ends inside the first W positions; past that, an
image token's row misses the keys [p - W + 1, last - W] at the far end of its window (one line
logged at start, `window_anchors_wanted`)."""
from __future__ import annotations

import logging

from ..backend_contract import BackendInterface
from ..scheduling.output import ScheduledRequest

logger = logging.getLogger(__name__)


def window_anchors_wanted(model, backend: BackendInterface) -> bool:
    """Whether a step's image rows carry window anchors (core/execution/runner.py build_step_input):
    the model's image tokens attend both ways, it has sliding-window layers, and the backend honours
    anchors. Where only the backend falls short, logs one line if it runs vision encoders (else images
    are refused, core/multimodal/processor.py): image tokens past the window are approximate there."""
    if not model.bidirectional_images or not any(spec.sliding_window for spec in model.attention_specs):
        return False
    capabilities = backend.capabilities()
    honoured = capabilities.window_anchors
    if not honoured and capabilities.vision_encoders:
        logger.warning("backend %s: its attention takes no per-row window anchors "
                       "(Capabilities.window_anchors): image tokens past the sliding window are attended "
                       "approximately (core/multimodal/image_rows.py)", backend.name)
    return honoured


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
