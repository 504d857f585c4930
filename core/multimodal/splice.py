"""A step's input embeddings with its images' embeddings written over their image tokens.

The runner lays the step's requests out one after another (core/execution/runner.py
order_for_attention); for each scheduled chunk and each image it touches (ScheduledRequest.images)
the positions of the chunk that take that image's rows get them, from the encoder cache or the
vision tower run now. That miss is the one place an image's pixels are asked for (pixels.py: made
then where add_request did not make them)."""
from __future__ import annotations

import torch

from ..scheduling.output import ScheduledRequest
from .encoder_cache import EncoderCache


def spliced_embeddings(model, input_ids: torch.Tensor, ordered: list[ScheduledRequest],
                       cache: EncoderCache) -> torch.Tensor:
    """model.embed_tokens(input_ids) [T, hidden], image rows written in."""
    embeds = model.embed_tokens(input_ids)
    first = 0
    for scheduled in ordered:
        start, count = scheduled.num_computed_tokens, len(scheduled.token_ids)
        for span in scheduled.images:
            encoded = cache.get(span.content_hash,
                                lambda span=span: model.encode_images(span.pixels.frames().to(embeds.device)))
            if encoded.shape[0] != span.num_embeddings:
                raise ValueError(f"the vision tower gave {encoded.shape[0]} rows for an image of "
                                 f"{span.num_embeddings} image tokens")
            rows, flat = [], []
            for row, offset in enumerate(span.embed_offsets):
                position = span.offset + offset
                if start <= position < start + count:
                    rows.append(row)
                    flat.append(first + position - start)
            if rows:
                index = torch.tensor(flat, device=embeds.device)
                embeds[index] = encoded[torch.tensor(rows, device=encoded.device)].to(embeds.dtype)
        first += count
    return embeds
