"""Gemma 3's vision-language model through the engine (core/models/gemma3_vision.py,
core/multimodal/gemma3.py, core/multimodal/image_rows.py): a tiny random-weight checkpoint saved
with its processor; greedy tokens and log-probabilities against transformers' generate, whose
prefill attends an image's soft tokens to each other both ways (token_type_ids); the prompt ids
the family expands to against transformers' processor's; chunked prompts that would end inside
an image; the prefix cache, with a hit that ends inside an image; the runner with and without
by_row. The text model has a sliding-window layer, which every answer crosses; an image past the
window is exact where the backend honours window anchors (the CPU's C++ decode kernel and gather
path), and approximate, with one logged line, where it does not."""
from __future__ import annotations

import dataclasses
import io
import logging

import pytest
import torch

from switchyard.backends.cpu.backend import CpuBackend
from switchyard.core.execution import runner as runner_module

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.multimodal.inputs import ImageData, ImageSpan
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.encoder_budget import fit_images, stop_outside_images
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_gemma3_vl import SLIDING_WINDOW, TOKENS_PER_IMAGE, tiny_gemma3_vl
from switchyard.core.testing.tiny_vlm import hf_greedy_scored, png_bytes

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf, processor = tiny_gemma3_vl(path)
    assert processor.image_seq_length == hf.config.mm_tokens_per_image == TOKENS_PER_IMAGE
    return path, hf, processor


def image(width: int, height: int, seed: int) -> ImageData:
    return ImageData.of(png_bytes(width, height, seed), width, height, "PNG")


def prompt_text(processor, *pieces) -> str:
    """A user turn of text and images (None: an image), rendered by the model's chat template."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def hf_greedy(hf, processor, text: str, images: list[ImageData], bidirectional: bool = True):
    """transformers' (prompt ids, greedy tokens, their log-probabilities); `bidirectional` False:
    without token_type_ids, so image tokens are attended causally."""
    from PIL import Image

    pictures = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in images]
    inputs = processor(text=text, images=pictures or None, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    return inputs["input_ids"][0].tolist(), *hf_greedy_scored(hf, inputs, NUM_TOKENS)


def make_engine(path, by_row: bool, budget: int = 2048, num_blocks: int = 128, backend=None) -> EngineCore:
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(path)),
                                     cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=budget), backend="cpu",
                                     compile_decode=False), backend)
    engine.runner.by_row = by_row  # the CPU runner's choice for a float model is off; both must hold
    return engine


def run(engine: EngineCore, requests: list[Request], steps: list | None = None) -> dict:
    """{request id: (tokens, logprobs, cached tokens)}; `steps`: each step's SchedulerOutput."""
    for request in requests:
        engine.add_request(request)
    outputs = {r.request_id: ([], []) for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = outputs[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or ())
        if steps is not None and engine.last_scheduler_output is not None:
            steps.append(engine.last_scheduler_output)
    return {r.request_id: (*outputs[r.request_id], r.num_cached_tokens) for r in requests}


def vision_request(processor, request_id: str, text: str, images: list[ImageData]) -> Request:
    return Request(request_id, processor.tokenizer.encode(text, add_special_tokens=False), GREEDY,
                   images=tuple(images))


def assert_matches(result, tokens, logprobs):
    assert result[0] == tokens
    torch.testing.assert_close(torch.tensor(result[1]), torch.tensor(logprobs), atol=2e-4, rtol=0)


CASES = {  # the first two put an image right after "user\n" and two images side by side: merged newlines
    "one image": [None, "what is this?"],
    "two images": [None, None, "compare them"],
    "text between": ["first", None, "then the second", None, "which is red?"],
}
IMAGES = [image(50, 40, 1), image(20, 30, 2)]


@pytest.mark.parametrize("by_row", [False, True], ids=["chunk rows", "by_row"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_and_logprobs_match_transformers(vlm, case, by_row):
    path, hf, processor = vlm
    pieces = CASES[case]
    images = IMAGES[:pieces.count(None)]
    text = prompt_text(processor, *pieces)
    ids, tokens, logprobs = hf_greedy(hf, processor, text, images)
    request = vision_request(processor, "r", text, images)
    result = run(make_engine(path, by_row), [request])["r"]
    assert request.prompt_token_ids == ids  # the family expands to the processor's ids, newlines merged
    assert len(ids) + NUM_TOKENS > SLIDING_WINDOW  # the answer crosses the sliding window
    assert all(span.image_run[1] < SLIDING_WINDOW for span in request.image_spans)
    assert_matches(result, tokens, logprobs)


PAST_THE_WINDOW = ("The quick brown fox jumps over the lazy dog. Numbers 0123456789.", None, "what?")


def record_anchors(monkeypatch) -> list:
    """The window anchors of every step the runner builds, from now on."""
    seen = []
    build = runner_module.build_step_input

    def recording(*args, **kwargs):
        step = build(*args, **kwargs)
        seen.append(step.meta.window_anchors_cpu)
        return step

    monkeypatch.setattr(runner_module, "build_step_input", recording)
    return seen


@pytest.mark.parametrize("in_place", [True, False], ids=["C++ decode kernel", "gather path"])
@pytest.mark.parametrize("by_row", [False, True], ids=["chunk rows", "by_row"])
def test_an_image_past_the_sliding_window(vlm, by_row, in_place, monkeypatch):
    """Its tokens' rows carry window anchors (their own positions), so each sees the keys
    [position - W + 1, image end], as transformers' mask gives it."""
    path, hf, processor = vlm
    text = prompt_text(processor, *PAST_THE_WINDOW)
    _, tokens, logprobs = hf_greedy(hf, processor, text, IMAGES[:1])
    request = vision_request(processor, "r", text, IMAGES[:1])
    engine = make_engine(path, by_row, backend=CpuBackend(in_place_decode=in_place))
    assert engine.runner.window_anchors
    anchors = record_anchors(monkeypatch)
    result = run(engine, [request])["r"]
    first, last = request.image_spans[0].image_run
    assert last >= SLIDING_WINDOW
    assert any(a is not None and first in a for a in anchors)  # the step with the image's rows
    assert all(a is None for a in anchors[1:])  # the decodes after it: none
    assert_matches(result, tokens, logprobs)


class AnchorlessCpuBackend(CpuBackend):
    """The CPU backend declaring no window anchors (as TPU and XPU do)."""

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), window_anchors=False)


def test_a_backend_without_window_anchors_gets_none_and_says_so(vlm, monkeypatch, caplog):
    """No step carries anchors, start logs one line, and an image past the window is approximate:
    what the anchors fix."""
    path, hf, processor = vlm
    text = prompt_text(processor, *PAST_THE_WINDOW)
    _, tokens, logprobs = hf_greedy(hf, processor, text, IMAGES[:1])
    with caplog.at_level(logging.WARNING, logger="switchyard.core.multimodal.image_rows"):
        engine = make_engine(path, by_row=False, backend=AnchorlessCpuBackend())
    lines = [r.getMessage() for r in caplog.records if r.name == "switchyard.core.multimodal.image_rows"]
    assert len(lines) == 1 and "image tokens past the sliding window are attended approximately" in lines[0]
    assert not engine.runner.window_anchors
    anchors = record_anchors(monkeypatch)
    result = run(engine, [vision_request(processor, "r", text, IMAGES[:1])])["r"]
    assert anchors and all(a is None for a in anchors)
    assert max(abs(a - b) for a, b in zip(result[1], logprobs)) > 1e-3


def test_image_tokens_attended_causally_do_not_match(vlm):
    """The parity above fails where the image tokens are attended causally: transformers' own causal
    run differs, and so does the engine's with its image rows turned off."""
    path, hf, processor = vlm
    text = prompt_text(processor, "first", None, "then the second", None, "which is red?")
    _, tokens, logprobs = hf_greedy(hf, processor, text, IMAGES)
    _, _, causal = hf_greedy(hf, processor, text, IMAGES, bidirectional=False)
    assert max(abs(a - b) for a, b in zip(logprobs, causal)) > 1e-3
    engine = make_engine(path, by_row=False)
    engine.runner.bidirectional_images = False
    engine_causal = run(engine, [vision_request(processor, "r", text, IMAGES)])["r"]
    torch.testing.assert_close(torch.tensor(engine_causal[1]), torch.tensor(causal), atol=2e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(engine_causal[1], logprobs)) > 1e-3


@pytest.mark.parametrize("by_row", [False, True], ids=["chunk rows", "by_row"])
@pytest.mark.parametrize("budget", [5, 3])
def test_a_chunked_prompt_never_ends_a_chunk_inside_an_image(vlm, budget, by_row):
    """Budgets that would cut each image's soft tokens (5), or that are smaller than them (3: the
    image runs whole as its step's first, past the budget): no chunk ends inside an image, and the
    answer is transformers'."""
    path, hf, processor = vlm
    text = prompt_text(processor, "first", None, "then the second", None, "which is red?")
    _, tokens, logprobs = hf_greedy(hf, processor, text, IMAGES)
    steps: list = []
    engine = make_engine(path, by_row, budget=budget)
    assert engine.config.scheduler.whole_images
    result = run(engine, [vision_request(processor, "r", text, IMAGES)], steps)["r"]
    assert_matches(result, tokens, logprobs)
    chunks = [s for step in steps for s in step.scheduled if s.images]
    assert chunks
    for chunk in chunks:
        stop = chunk.num_computed_tokens + len(chunk.token_ids)
        for span in chunk.images:
            first, last = span.image_run
            assert not first < stop <= last, (chunk, span)
    if budget < TOKENS_PER_IMAGE:
        assert max(step.num_batched_tokens for step in steps) > budget
    assert engine.runner.encoder_cache.num_encoded == 2


def test_a_chunk_that_ends_inside_an_image_is_refused_by_the_runner(vlm):
    """Without whole images in the scheduler, a chunk ends inside an image: its rows cannot attend
    to the image's later tokens, and the runner says so rather than attend them causally."""
    from dataclasses import replace

    path, hf, processor = vlm
    engine = make_engine(path, by_row=False, budget=3)  # smaller than an image's 4 soft tokens
    engine.scheduler.config = replace(engine.scheduler.config, whole_images=False)
    text = prompt_text(processor, "first", None, "then the second", None, "which is red?")
    with pytest.raises(ValueError, match="ends inside an image"):
        run(engine, [vision_request(processor, "r", text, IMAGES)])


@pytest.mark.parametrize("by_row", [False, True], ids=["chunk rows", "by_row"])
def test_prefix_cache_hits_through_and_inside_an_image(vlm, by_row):
    """The same image again hits the cache through the image; with the block after the image's first
    soft tokens evicted, a hit that ends inside the image (its keys computed with the whole image)
    and the rest of its soft tokens in one chunk: the same answer as transformers."""
    path, hf, processor = vlm
    text = prompt_text(processor, "the look", None, "what is this picture about?")
    images = [image(50, 40, 7)]
    _, tokens, logprobs = hf_greedy(hf, processor, text, images)
    engine = make_engine(path, by_row)
    first = vision_request(processor, "a", text, images)
    assert_matches(run(engine, [first])["a"], tokens, logprobs)
    again = run(engine, [vision_request(processor, "b", text, images)])["b"]
    run_start, run_end = first.image_spans[0].image_run
    assert again[2] > run_end
    assert_matches(again, tokens, logprobs)
    block = (run_start // 4) + 1  # the block after the one holding the image's first soft token
    assert run_start < block * 4 <= run_end
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.uncache(pool.cached_block(first.block_hashes[block]))
    inside = run(engine, [vision_request(processor, "c", text, images)])["c"]
    assert inside[2] == block * 4
    assert_matches(inside, tokens, logprobs)


def test_fit_images_keeps_an_image_whole():
    span = ImageSpan(offset=10, length=8, content_hash="x", embed_offsets=(2, 3, 4, 5))  # run [12, 15]
    spans = (span,)
    assert fit_images(spans, 0, 14, 0, 100) == 14  # not whole: anywhere
    assert fit_images(spans, 0, 14, 0, 100, whole=True) == 12  # stops before the run
    assert fit_images(spans, 0, 16, 0, 100, whole=True) == 16  # the run ends the chunk
    assert fit_images(spans, 12, 2, 0, 100, whole=True) == 4  # starts at the run: all of it, past 2
    assert fit_images(spans, 13, 1, 0, 100, whole=True) == 3  # inside it (a prefix hit): the rest
    assert fit_images(spans, 12, 2, 4, 100, whole=True) == 0  # not the step's first image: next step
    assert stop_outside_images(spans, 0, 14) == 12
    assert stop_outside_images(spans, 12, 2) == 0
    assert stop_outside_images(spans, 0, 20) == 20
