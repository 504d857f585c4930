"""Qwen2-VL through the engine (core/models/qwen2_vl.py, qwen2_vision.py, core/multimodal/qwen2_vl.py,
positions.py): a tiny random-weight checkpoint, greedy tokens and log-probabilities against
transformers' generate; M-RoPE positions across chunk boundaries inside and after an image, the
prefix cache, and decodes on the CPU's fused C++ decode layers (1D positions shifted past the
images)."""
from __future__ import annotations

import io

import pytest
import torch

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.multimodal.families import FAMILIES
from switchyard.core.multimodal.inputs import ImageData, ImageSpan
from switchyard.core.multimodal.positions import grid_positions, position_shift, shifted
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.output import ScheduledRequest
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_qwen2_vl import processor_inputs, tiny_qwen2_vl
from switchyard.core.testing.tiny_vlm import hf_greedy_scored, png_bytes

from mmproj_pairs import greedy_answers

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_vl")
    hf, tokenizer, image_processor = tiny_qwen2_vl(path)
    return path, hf, tokenizer, image_processor


def image(width: int, height: int, seed: int) -> ImageData:
    return ImageData.of(png_bytes(width, height, seed), width, height, "PNG")


def prompt_text(tokenizer, *pieces) -> str:
    """A user turn of text and images (None: an image), rendered by the chat template."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def hf_greedy(vlm, text: str, images: list[ImageData]) -> tuple[list[int], list[float]]:
    from PIL import Image

    _, hf, tokenizer, image_processor = vlm
    pictures = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in images]
    inputs = processor_inputs(tokenizer, image_processor, text, pictures)
    return hf_greedy_scored(hf, inputs, NUM_TOKENS)


def make_engine(path, budget: int = 2048, compile_decode: bool = False) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(model=str(path)), cache=CacheConfig(block_size=4, num_blocks=128),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=budget), backend="cpu",
                                   compile_decode=compile_decode))


def run(engine: EngineCore, requests: list[Request]) -> dict[str, tuple[list[int], list[float], int]]:
    """greedy_answers, with each request's cached prompt tokens."""
    outputs = greedy_answers(engine, requests)
    return {r.request_id: (*outputs[r.request_id], r.num_cached_tokens) for r in requests}


def request(vlm, request_id: str, text: str, images: list[ImageData]) -> Request:
    ids = vlm[2].encode(text, add_special_tokens=False)
    return Request(request_id, ids, GREEDY, images=tuple(images))


def assert_matches(got, expected) -> None:
    assert got[0] == expected[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), atol=2e-4, rtol=0)


# sizes give merged grids (h, w): 112x56 -> 2x4 (8 tokens, delta -4), 30x90 -> 3x1 (delta 0),
# 64x48 -> 2x2 (delta -2), 84x84 -> 3x3 (delta -6)
CASES = {
    "one image": ([None, "what is this?"], [(112, 56, 1)]),
    "two images": ([None, None, "compare them"], [(64, 48, 2), (30, 90, 3)]),
    "text between": (["first", None, "then the second", None, "which is red?"], [(84, 84, 4), (112, 56, 5)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_and_logprobs_match_transformers(vlm, case):
    pieces, sizes = CASES[case]
    images = [image(w, h, seed) for w, h, seed in sizes]
    text = prompt_text(vlm[2], *pieces)
    got = run(make_engine(vlm[0]), [request(vlm, "r", text, images)])["r"]
    assert_matches(got, hf_greedy(vlm, text, images))


@pytest.mark.parametrize("budget", [3, 5, 16])
def test_chunks_cut_inside_and_after_images_keep_the_positions(vlm, budget):
    """Small budgets cut the prompt inside an image's tokens and in the text after it: a chunk
    starts with some of an image's tokens, or after images it does not touch (their shift comes
    from the scheduler, ScheduledRequest.position_shift); each image is encoded once."""
    images = [image(84, 84, 4), image(112, 56, 5)]
    text = prompt_text(vlm[2], "first", None, "then the second", None, "which is red?")
    engine = make_engine(vlm[0], budget=budget)
    got = run(engine, [request(vlm, "r", text, images)])["r"]
    assert_matches(got, hf_greedy(vlm, text, images))
    assert engine.runner.encoder_cache.num_encoded == 2


def test_requests_with_other_images_share_steps(vlm):
    """Two requests batched: one's decodes beside the other's image chunks; each keeps its own shift."""
    one = [image(112, 56, 1)]
    two = [image(84, 84, 4), image(112, 56, 5)]
    text_one = prompt_text(vlm[2], None, "what is this?")
    text_two = prompt_text(vlm[2], "first", None, "then the second", None, "which is red?")
    got = run(make_engine(vlm[0], budget=12), [request(vlm, "a", text_one, one), request(vlm, "b", text_two, two)])
    assert_matches(got["a"], hf_greedy(vlm, text_one, one))
    assert_matches(got["b"], hf_greedy(vlm, text_two, two))


def test_decodes_on_the_cpu_fused_decode_layers_take_the_shifted_positions(vlm):
    """`switchyard serve`'s default CPU runner: the image chunks through the model's forward (3D
    positions), every decode in C++ with 1D positions shifted by both images' deltas."""
    images = [image(84, 84, 4), image(112, 56, 5)]
    text = prompt_text(vlm[2], "first", None, "then the second", None, "which is red?")
    engine = make_engine(vlm[0], budget=16, compile_decode=True)
    got = run(engine, [request(vlm, "r", text, images)])["r"]
    assert engine.runner.num_fused_steps > 0
    assert_matches(got, hf_greedy(vlm, text, images))


def test_the_prefix_cache_serves_the_same_image_again(vlm):
    """The same image again: its blocks hit the prefix cache and the answer is the same (the text
    after the image keeps its shifted positions); another image shares nothing from its first block."""
    text = prompt_text(vlm[2], "look", None, "what is this picture about?")
    engine = make_engine(vlm[0])
    first = run(engine, [request(vlm, "a", text, [image(112, 56, 7)])])["a"]
    same = request(vlm, "b", text, [image(112, 56, 7)])
    second = run(engine, [same])["b"]
    assert second[2] >= same.image_spans[0].end - 4  # every full block through the image is shared
    assert_matches(second, first)
    assert_matches(first, hf_greedy(vlm, text, [image(112, 56, 7)]))
    other = request(vlm, "c", text, [image(112, 56, 8)])
    assert run(engine, [other])["c"][2] <= other.image_spans[0].offset


def test_the_family_expands_one_image_pad_per_merged_patch(vlm):
    from transformers import AutoImageProcessor
    from PIL import Image

    family = FAMILIES["qwen2_vl"](AutoImageProcessor.from_pretrained(vlm[0]), 4)
    frames, expansion = family.prepare(Image.open(io.BytesIO(png_bytes(112, 56, 1))).convert("RGB"), True)
    assert frames.grid == (1, 4, 8) and frames.patches.shape == (32, 3 * 2 * 14 * 14)
    assert expansion.grid == (1, 2, 4) and expansion.tokens == (4,) * 8 and expansion.embed_offsets == tuple(range(8))
    assert family.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"


def test_detail_low_caps_the_pixels(vlm):
    """split False (OpenAI's detail "low"): at most 448*448 pixels, far fewer image tokens."""
    from transformers import AutoImageProcessor
    from PIL import Image

    family = FAMILIES["qwen2_vl"](AutoImageProcessor.from_pretrained(vlm[0], max_pixels=28 * 28 * 1280), 4)
    picture = Image.new("RGB", (1000, 800))
    high, low = family.prepare(picture, True)[1], family.prepare(picture, False)[1]
    assert len(high.tokens) == 29 * 36 and len(low.tokens) == 14 * 17 <= 256
    assert family.frames(picture, False).grid == (1, 28, 34)


def test_positions_follow_each_images_grid():
    """transformers' get_rope_index on text, a 2x3 image at 2, text, a 1x1 image, text."""
    spans = (ImageSpan(2, 6, "a", tuple(range(6)), grid=(1, 2, 3)), ImageSpan(10, 1, "b", (0,), grid=(1, 1, 1)))
    whole = shifted(spans, 0, 13, 0)
    assert whole == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9]  # after the first image: 8 - 3
    for start in range(13):  # any chunk start: the same positions
        touched = tuple(s for s in spans if s.end > start)
        assert shifted(touched, start, 13 - start, position_shift(spans, start)) == whole[start:]
    scheduled = ScheduledRequest("r", (0,) * 9, 4, (), True, images=spans, position_shift=0)
    rows = grid_positions([scheduled], whole[4:])
    assert rows == [[2, 2, 2, 2, 5, 6, 7, 8, 9], [2, 3, 3, 3, 5, 6, 7, 8, 9], [4, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def vlm25(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf, tokenizer, image_processor = tiny_qwen2_vl(path, family="qwen2_5_vl")
    return path, hf, tokenizer, image_processor


@pytest.mark.parametrize("budget", [2048, 5])
def test_qwen2_5_vl_window_attention_tower_matches_transformers(vlm25, budget):
    """Qwen2.5-VL's tower (RMSNorm, SwiGLU, window attention over 2x2 merge units, block 1 full):
    images of one window, of several, and with windows padded at the edges; whole and chunked."""
    images = [image(84, 84, 4), image(112, 56, 5), image(30, 90, 6)]
    text = prompt_text(vlm25[2], "first", None, "then", None, "and", None, "which is red?")
    engine = make_engine(vlm25[0], budget=budget, compile_decode=budget != 2048)
    got = run(engine, [request(vlm25, "r", text, images)])["r"]
    assert_matches(got, hf_greedy(vlm25, text, images))


def test_decode_graph_buffers_stage_the_shifted_position():
    """Graph runners (CUDA graphs, compiled CPU decode) stage a decode's position themselves."""
    from switchyard.core.execution.decode_batch import DecodeBuffers

    buffers = DecodeBuffers(max_batch=2, max_blocks=4, block_size=4, device=torch.device("cpu"), pin=False)
    decode = ScheduledRequest("r", (7,), 9, (3, 5, 6), True, position_shift=-4)
    buffers.stage((decode,), 2)
    assert buffers.tokens[:, 0].tolist() == [7, 5, 6 * 4 + 1]  # token, position 9 - 4, slot of index 9


def test_a_graph_never_runs_a_step_that_computes_an_image_token():
    """decode_only: a one-token chunk of an image's placeholder takes the model's own forward (the
    image's row is its input embedding), not a decode graph."""
    from switchyard.core.execution.decode_batch import decode_only
    from switchyard.core.scheduling.output import SchedulerOutput

    span = ImageSpan(2, 4, "h", (0, 1, 2, 3), grid=(1, 2, 2))
    decode = ScheduledRequest("d", (7,), 9, (3, 5, 6), True)
    image_token = ScheduledRequest("i", (5,), 3, (3,), True, images=(span,))
    assert decode_only(SchedulerOutput(scheduled=(decode,)))
    assert not decode_only(SchedulerOutput(scheduled=(decode, image_token)))
