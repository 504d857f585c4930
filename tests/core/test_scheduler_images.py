"""The scheduler's share of images (core/multimodal): which images a chunk carries, the encoder
budget (core/scheduling/encoder_budget.py), and prefix-cache keys by image content."""
from __future__ import annotations

from fake_runner import make_request, make_scheduler

from switchyard.core.multimodal.inputs import ImageSpan, block_extra_key

IMAGE_TOKEN = 7


def with_image(request_id: str, content_hash: str, before: int = 6, rows: int = 8, after: int = 4):
    """A request whose prompt holds one image placeholder of `rows` image tokens after `before` tokens."""
    prompt = list(range(10, 10 + before)) + [IMAGE_TOKEN] * rows + list(range(40, 40 + after))
    request = make_request(request_id, prompt, max_tokens=2)
    request.image_spans = (ImageSpan(before, rows, content_hash, tuple(range(rows))),)
    return request


def test_chunks_carry_the_images_they_touch():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = with_image("a", "h1")
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.scheduled[0].images == request.image_spans  # positions 0..7 reach the image at 6
    scheduler.update(first, {})
    second = scheduler.schedule()
    assert second.scheduled[0].images == request.image_spans
    scheduler.update(second, {})
    third = scheduler.schedule()
    assert third.scheduled[0].images == ()  # the prompt's tail


def test_a_step_starts_no_image_past_the_encoder_budget():
    """Budget 16 tokens and 16 encoder rows: r0's 10-row image fits; r1's chunk stops before its
    own 10-row image (20 rows), which starts in the next step."""
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    requests = [with_image(f"r{i}", f"h{i}", before=1, rows=10, after=1) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    step = scheduler.schedule()
    assert {s.request_id: s.num_new_tokens for s in step.scheduled} == {"r0": 12, "r1": 1}
    scheduler.update(step, {"r0": 1})
    step = scheduler.schedule()
    assert {s.request_id: s.num_new_tokens for s in step.scheduled} == {"r0": 1, "r1": 11}
    big = make_scheduler(max_num_batched_tokens=4)
    alone = with_image("big", "hb", before=0, rows=8, after=0)
    big.add_request(alone)
    assert big.schedule().scheduled[0].num_new_tokens == 4  # an image larger than the budget still runs


def test_block_keys_name_the_images_a_block_holds():
    span = ImageSpan(6, 8, "h1", tuple(range(8)))
    assert block_extra_key((span,), 0, 4) == b""
    assert block_extra_key((span,), 4, 8) == block_extra_key((span,), 12, 16) != b""
    assert block_extra_key((ImageSpan(6, 8, "h2", tuple(range(8))),), 4, 8) != block_extra_key((span,), 4, 8)


def test_the_prefix_cache_shares_blocks_of_the_same_image_only():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    first = with_image("a", "same")
    scheduler.add_request(first)
    step = scheduler.schedule()
    scheduler.update(step, {"a": 1})
    same, other = with_image("b", "same"), with_image("c", "other")
    scheduler.add_request(same)
    scheduler.add_request(other)
    scheduler.schedule()
    assert same.num_cached_tokens == 16  # every full block (prompt of 18, block 4)
    assert other.num_cached_tokens == 4  # the block before the image only
