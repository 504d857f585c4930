"""Images in, text out through the engine (core/multimodal, core/models/idefics3.py): a tiny
random-weight Idefics3 saved with its processor, greedy tokens and log-probabilities against
transformers' generate; chunked prompts; the prefix cache keyed by the image's content hash."""
from __future__ import annotations

import io

import pytest
import torch

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_vlm import hf_greedy_scored, png_bytes, tiny_idefics3

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    hf, processor = tiny_idefics3(path)
    return path, hf, processor


def image(width: int, height: int, seed: int) -> ImageData:
    data = png_bytes(width, height, seed)
    return ImageData.of(data, width, height, "PNG")


def prompt_text(processor, *pieces) -> str:
    """A user turn of text and images (None: an image), rendered by the model's chat template."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def hf_greedy(hf, processor, text: str, images: list[ImageData]) -> tuple[list[int], list[float]]:
    from PIL import Image

    pictures = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in images]
    inputs = processor(text=text, images=pictures or None, return_tensors="pt")
    return hf_greedy_scored(hf, inputs, NUM_TOKENS)


def make_engine(path, budget: int = 2048, num_blocks: int = 128, compile_decode: bool = False) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(model=str(path)),
                                   cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=budget), backend="cpu",
                                   compile_decode=compile_decode))


def run(engine: EngineCore, requests: list[Request]) -> dict[str, tuple[list[int], list[float], int]]:
    for request in requests:
        engine.add_request(request)
    outputs = {r.request_id: ([], [], 0) for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _ = outputs[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or ())
    for request in requests:
        tokens, logprobs, _ = outputs[request.request_id]
        outputs[request.request_id] = (tokens, logprobs, request.num_cached_tokens)
    return outputs


def vision_request(processor, request_id: str, text: str, images: list[ImageData]) -> Request:
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    return Request(request_id, ids, GREEDY, images=tuple(images))


CASES = {
    "one image": (("what is this?",), [None, "what is this?"], [(64, 48, 1)]),
    "two images": ((), [None, None, "compare them"], [(64, 48, 2), (20, 30, 3)]),
    "text between": ((), ["first", None, "then the second", None, "which is red?"], [(40, 40, 4), (64, 64, 5)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_and_logprobs_match_transformers(vlm, case):
    path, hf, processor = vlm
    _, pieces, sizes = CASES[case]
    images = [image(w, h, seed) for w, h, seed in sizes]
    text = prompt_text(processor, *pieces)
    expected_tokens, expected_logprobs = hf_greedy(hf, processor, text, images)
    engine = make_engine(path)
    tokens, logprobs, _ = run(engine, [vision_request(processor, "r", text, images)])["r"]
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-4, rtol=0)


def test_smolvlm_checkpoints_are_served_by_the_same_code(tmp_path):
    hf, processor = tiny_idefics3(tmp_path, seed=2, family="smolvlm")
    images = [image(64, 48, 2), image(20, 30, 3)]
    text = prompt_text(processor, None, "hi", None)
    expected_tokens, expected_logprobs = hf_greedy(hf, processor, text, images)
    tokens, logprobs, _ = run(make_engine(tmp_path), [vision_request(processor, "r", text, images)])["r"]
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-4, rtol=0)


def test_a_chunked_prompt_encodes_each_image_once_and_answers_alike(vlm):
    """A 5-token budget cuts every image's placeholder across steps: the same answer, and each
    image is encoded once (the encoder cache), though its rows are spread over several chunks."""
    path, hf, processor = vlm
    images = [image(64, 48, 2), image(20, 30, 3)]
    text = prompt_text(processor, None, "and", None, "compare them")
    whole = run(make_engine(path), [vision_request(processor, "r", text, images)])["r"]
    engine = make_engine(path, budget=5)
    chunked = run(engine, [vision_request(processor, "r", text, images)])["r"]
    assert chunked[0] == whole[0]
    torch.testing.assert_close(torch.tensor(chunked[1]), torch.tensor(whole[1]), atol=2e-4, rtol=0)
    assert engine.runner.encoder_cache.num_encoded == 2


def test_the_cpu_fused_decode_layers_run_the_text_model_decodes(vlm):
    """`switchyard serve`'s default CPU runner: decodes in C++ through the text model's declared
    layout, image chunks through the model's forward; the same tokens as transformers."""
    path, hf, processor = vlm
    images = [image(64, 48, 2), image(20, 30, 3)]
    text = prompt_text(processor, None, "and", None, "compare them")
    expected_tokens, expected_logprobs = hf_greedy(hf, processor, text, images)
    engine = make_engine(path, budget=16, compile_decode=True)
    tokens, logprobs, _ = run(engine, [vision_request(processor, "r", text, images)])["r"]
    assert engine.runner.num_fused_steps > 0
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=2e-4, rtol=0)


def test_prefix_cache_keys_image_tokens_by_content(vlm):
    """Equal placeholder tokens with a different image share only the blocks before the image;
    the same image shares its blocks too."""
    path, hf, processor = vlm
    text = prompt_text(processor, "look", None, "what is this picture about?")
    first, same, other = image(64, 48, 7), image(64, 48, 7), image(64, 48, 8)
    engine = make_engine(path)
    run(engine, [vision_request(processor, "a", text, [first])])
    request_same = vision_request(processor, "b", text, [same])
    request_other = vision_request(processor, "c", text, [other])
    outputs = run(engine, [request_same])
    outputs.update(run(engine, [request_other]))
    span = request_other.image_spans[0]
    assert outputs["b"][2] >= span.end - 4  # every full block through the image is shared
    assert outputs["c"][2] <= span.offset  # nothing from the image's first block on
    alone = run(make_engine(path), [vision_request(processor, "c", text, [other])])["c"]
    assert outputs["c"][0] == alone[0]


def test_placeholders_must_pair_with_images(vlm):
    path, hf, processor = vlm
    engine = make_engine(path)
    text = prompt_text(processor, None, "two?")
    with pytest.raises(ValidationError, match="1 image placeholders"):
        engine.add_request(vision_request(processor, "r", text, [image(32, 32, 1), image(32, 32, 2)]))


def test_a_backend_without_vision_encoders_serves_text_only(vlm, caplog):
    """Capabilities.vision_encoders False: one warning at start, then a request with images is refused."""
    from types import SimpleNamespace

    from switchyard.core.backend_contract import Capabilities
    from switchyard.core.multimodal.processor import image_prompts_for, prepare_images
    from switchyard.core.models.idefics3 import Idefics3ForConditionalGeneration

    model = SimpleNamespace(image_family=Idefics3ForConditionalGeneration.image_family, image_token_id=4)
    backend = SimpleNamespace(name="textonly", capabilities=lambda: Capabilities(dtypes=("float32",),
                                                                                block_sizes=(16,)))
    with caplog.at_level("WARNING"):
        assert image_prompts_for(SimpleNamespace(model=model, source=None), backend) is None
    assert "does not run vision encoders" in caplog.text
    with pytest.raises(ValidationError, match="reads text only"):
        prepare_images(None, Request("r", [1, 4, 2], GREEDY, images=(image(8, 8, 1),)))
    prepare_images(None, Request("t", [1, 2], GREEDY))  # text: nothing to do


def test_the_vision_tower_runs_in_its_own_dtype(vlm):
    """ModelConfig.vision_dtype (core/capabilities.py sets it beside integer weights): the tower and
    connector in bfloat16, the text model in float32; the image rows reach the float32 text model and
    the answer stays close to the all-float32 one (its first token's log-probability within bf16's
    rounding)."""
    path, hf, processor = vlm
    text = prompt_text(processor, None, "what is this?")
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(path), vision_dtype="bfloat16"),
                                     cache=CacheConfig(block_size=4, num_blocks=128), backend="cpu"))
    model = engine.runner.model
    assert {p.dtype for m in model.vision_modules() for p in m.parameters()} == {torch.bfloat16}
    assert model.language.model.embed_tokens.weight.dtype == torch.float32
    tokens, logprobs, _ = run(engine, [vision_request(processor, "b", text, [image(64, 48, 3)])])["b"]
    expected = run(make_engine(path), [vision_request(processor, "f", text, [image(64, 48, 3)])])["f"]
    assert len(tokens) == NUM_TOKENS
    assert abs(logprobs[0] - expected[1][0]) < 0.05
