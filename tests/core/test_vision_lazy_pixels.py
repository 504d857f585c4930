"""An image seen before is not processed again at add_request (core/multimodal/processor.py's
expansion memo); its pixels are made only when the vision tower has to run on them
(core/multimodal/pixels.py), and then equal those of the first time. An image not split
(ImageData.split False: the gateway's detail "low") expands as transformers' processor with
do_image_splitting=False, and answers as transformers does on it."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.multimodal.encoder_cache import EncoderCache
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.multimodal.processor import ExpansionMemo
from switchyard.core.params import ValidationError
from switchyard.core.testing.tiny_vlm import png_bytes, tiny_idefics3
from test_vision_engine import NUM_TOKENS, hf_greedy, image, prompt_text, run, vision_request


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    hf, processor = tiny_idefics3(path)
    return path, hf, processor


class Counting:
    """An image processor that counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def counted_engine(path, prefix_caching: bool = True) -> tuple[EngineCore, Counting]:
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(path)),
                                     cache=CacheConfig(block_size=4, num_blocks=128,
                                                       enable_prefix_caching=prefix_caching),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=2048), backend="cpu"))
    counting = Counting(engine.image_prompts.processor.image_processor)
    engine.image_prompts.processor.image_processor = counting
    return engine, counting


def drain(engine: EngineCore) -> dict[str, tuple[list[int], list[float]]]:
    """Steps the engine's requests (added already) to their ends: their tokens and logprobs."""
    outputs: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = outputs.setdefault(out.request_id, ([], []))
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or ())
    return outputs


def test_a_repeated_image_and_prompt_is_not_processed_again(vlm):
    """The prefix cache covers the image's tokens: no image processor, no vision tower, the same answer."""
    path, hf, processor = vlm
    text = prompt_text(processor, "look", None, "what is this picture about?")
    engine, counting = counted_engine(path)
    first = run(engine, [vision_request(processor, "a", text, [image(64, 48, 7)])])["a"]
    assert (counting.calls, engine.runner.encoder_cache.num_encoded) == (1, 1)
    again = vision_request(processor, "b", text, [image(64, 48, 7)])
    second = run(engine, [again])["b"]
    assert second[2] >= again.image_spans[0].end - 4  # the image's blocks came from the prefix cache
    assert (counting.calls, engine.runner.encoder_cache.num_encoded) == (1, 1)
    assert not again.image_spans[0].pixels.made
    assert second[0] == first[0]
    torch.testing.assert_close(torch.tensor(second[1]), torch.tensor(first[1]), atol=2e-4, rtol=0)


def test_a_repeated_image_in_another_prompt_takes_the_encoder_cache(vlm):
    path, hf, processor = vlm
    engine, counting = counted_engine(path)
    run(engine, [vision_request(processor, "a", prompt_text(processor, "look", None, "what?"), [image(64, 48, 7)])])
    text = prompt_text(processor, "something else first", None, "and what is this?")
    later = vision_request(processor, "b", text, [image(64, 48, 7)])
    tokens, logprobs, cached = run(engine, [later])["b"]
    assert cached <= later.image_spans[0].offset  # its image tokens were computed again ...
    assert (counting.calls, engine.runner.encoder_cache.num_encoded) == (1, 1)  # ... from cached rows
    assert not later.image_spans[0].pixels.made
    expected_tokens, expected_logprobs = hf_greedy(hf, processor, text, [image(64, 48, 7)])
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-4, rtol=0)


def test_pixels_are_made_when_the_encoder_runs_again_and_answer_alike(vlm):
    """No prefix cache and the encoder cache emptied in between: the memoised image's pixels are
    made at the step that encodes it, exactly as the first time, and so is the answer."""
    path, hf, processor = vlm
    text = prompt_text(processor, None, "what is this?")
    engine, counting = counted_engine(path, prefix_caching=False)
    first_request = vision_request(processor, "a", text, [image(64, 48, 3)])
    first = run(engine, [first_request])["a"]
    engine.runner.encoder_cache = EncoderCache()  # evicted
    again = vision_request(processor, "b", text, [image(64, 48, 3)])
    engine.add_request(again)
    assert counting.calls == 1 and not again.image_spans[0].pixels.made  # add_request processed nothing
    assert again.prompt_token_ids == first_request.prompt_token_ids
    assert again.image_spans == first_request.image_spans  # (spans compare without their pixels)
    tokens, logprobs = drain(engine)["b"]
    assert counting.calls == 2 and again.image_spans[0].pixels.made  # made once, for the encoder
    assert engine.runner.encoder_cache.num_encoded == 1
    torch.testing.assert_close(again.image_spans[0].pixels.frames(), first_request.image_spans[0].pixels.frames(),
                               atol=0, rtol=0)
    assert tokens == first[0] and len(tokens) == NUM_TOKENS
    assert logprobs == first[1]  # the same computation on the same pixels


def test_lazy_pixels_cross_a_process_as_their_frames(vlm):
    """A step's SchedulerOutput is pickled to the shard workers: a span's pixels pickle as frames."""
    path, hf, processor = vlm
    engine, counting = counted_engine(path)
    text = prompt_text(processor, None, "hi")
    made = vision_request(processor, "a", text, [image(40, 40, 4)])
    engine.add_request(made)
    lazy = vision_request(processor, "b", text, [image(40, 40, 4)])
    engine.add_request(lazy)
    assert counting.calls == 1
    crossed = pickle.loads(pickle.dumps(lazy.image_spans[0]))
    assert counting.calls == 2 and crossed.pixels.made
    torch.testing.assert_close(crossed.pixels.frames(), made.image_spans[0].pixels.frames(), atol=0, rtol=0)


def test_a_broken_image_is_refused_and_never_memoised(vlm):
    path, hf, processor = vlm
    engine, counting = counted_engine(path)
    text = prompt_text(processor, None, "hi")
    png = png_bytes(32, 32, 1)
    broken = ImageData.of(png[:len(png) // 2], 32, 32, "PNG")  # a header, half its data
    for request_id in ("a", "b"):
        with pytest.raises(ValidationError, match="image 0 could not be prepared"):
            engine.add_request(vision_request(processor, request_id, text, [broken]))
    assert engine.image_prompts.expansions.get(broken.key) is None
    assert not engine.has_unfinished_requests()
    tokens, _, _ = run(engine, [vision_request(processor, "c", text, [image(32, 32, 1)])])["c"]
    assert len(tokens) == NUM_TOKENS  # the engine goes on


def test_the_expansion_memo_is_bounded_least_recently_used_out():
    memo = ExpansionMemo(max_entries=2)
    memo.put("a", (1,))
    memo.put("b", (2,))
    assert memo.get("a") == (1,)
    memo.put("c", (3,))
    assert (memo.get("a"), memo.get("b"), memo.get("c")) == ((1,), None, (3,))


def test_an_unsplit_image_expands_and_answers_as_transformers_without_splitting(vlm):
    """ImageData.split False (detail "low"): the global view only, fewer image tokens, the
    prompt transformers' processor makes with do_image_splitting=False, and its answer; the
    same bytes split are another image to the caches."""
    from PIL import Image

    path, hf, processor = vlm
    text = prompt_text(processor, None, "what is this?")
    data = png_bytes(64, 48, 9)
    split, unsplit = ImageData.of(data, 64, 48, "PNG"), ImageData.of(data, 64, 48, "PNG", split=False)
    engine, counting = counted_engine(path)
    tiled = vision_request(processor, "tiled", text, [split])
    single = vision_request(processor, "single", text, [unsplit])
    outputs = run(engine, [tiled, single])
    assert counting.calls == 2 and engine.runner.encoder_cache.num_encoded == 2
    assert single.image_spans[0].num_embeddings < tiled.image_spans[0].num_embeddings
    assert single.image_spans[0].content_hash != tiled.image_spans[0].content_hash

    picture = Image.open(io.BytesIO(data)).convert("RGB")
    inputs = processor(text=text, images=[picture], return_tensors="pt", do_image_splitting=False)
    assert single.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert single.image_spans[0].num_embeddings == processor.image_seq_len  # one view
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    expected = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    expected_logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, expected)]
    tokens, logprobs, _ = outputs["single"]
    assert tokens == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-4, rtol=0)
