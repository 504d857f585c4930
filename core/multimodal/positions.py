"""Rotary positions of a prompt with images whose positions follow their grid (Qwen2-VL's M-RoPE).

Each token's rotary position is 3 ids (t, h, w). A text token's are 3 equal ids, an image token's
(base + t_i, base + h_i, base + w_i) over its image's grid (t, h, w after merging), `base` the
position of the image's first token; the text after an image continues from max(its positions) + 1.
So every token after an image is shifted by the image's delta, max(t, h, w) - its number of tokens
(transformers' get_rope_index). M-RoPE with t = h = w = q is plain 1D RoPE at q, so:

- every token's 1D position is its index plus the deltas of the images before it (`shifted`): the
  runner's StepInput.positions, which steps without image tokens (decodes, a backend's fused or
  graph decode) use as any model's positions;
- only a step that computes image tokens gives the model 3D positions (`grid_positions`), the
  image tokens' from their grid.

A family whose positions are plain has no grid (ImageSpan.grid == ()): its delta is 0. Torch-free:
the scheduler calls `position_shift` for each scheduled request with images
(ScheduledRequest.position_shift)."""
from __future__ import annotations

from .inputs import ImageSpan


def position_delta(span: ImageSpan) -> int:
    """How far an image shifts the positions of the tokens after it: its grid takes max(grid)
    positions for its `length` tokens; 0 for an image without a grid."""
    return max(span.grid) - span.length if span.grid else 0


def position_shift(spans: tuple[ImageSpan, ...], start: int) -> int:
    """The shift of the images wholly before position `start` (a chunk's first token): the deltas of
    those the chunk does not touch (ScheduledRequest.images holds the others)."""
    return sum(position_delta(s) for s in spans if s.end <= start)


def shifted(images: tuple[ImageSpan, ...], start: int, count: int, shift: int) -> list[int]:
    """The 1D positions of tokens [start, start + count): each its index plus `shift` plus the
    deltas of the chunk's `images` that end at or before it."""
    positions: list[int] = []
    position = start
    for span in sorted(images, key=lambda s: s.offset):
        stop = min(span.end, start + count)
        if position < stop:
            positions.extend(range(position + shift, stop + shift))
            position = stop
        if span.end <= start + count:
            shift += position_delta(span)
    positions.extend(range(position + shift, start + count + shift))
    return positions


def grid_positions(ordered, positions: list[int]) -> list[list[int]]:
    """The [3, T] positions of a step laid out as `ordered` (ScheduledRequests, one after another)
    whose 1D positions are `positions`: equal ids for every token but the image tokens, which take
    their image's base plus their (t, h, w) in its grid."""
    rows = [list(positions), list(positions), list(positions)]
    first = 0
    for scheduled in ordered:
        start, count = scheduled.num_computed_tokens, len(scheduled.token_ids)
        for span in scheduled.images:
            if not span.grid:
                continue
            base = span.offset + scheduled.position_shift + sum(
                position_delta(s) for s in scheduled.images if s.end <= span.offset)
            _, height, width = span.grid
            for row, offset in enumerate(span.embed_offsets):
                index = span.offset + offset - start
                if 0 <= index < count:
                    rows[0][first + index] = base + row // (height * width)
                    rows[1][first + index] = base + row // width % height
                    rows[2][first + index] = base + row % width
        first += count
    return rows
