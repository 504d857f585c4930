"""A vision-language model served from llama.cpp's GGUF pair (`--model-id TEXT.gguf --mmproj
MMPROJ.gguf`, core/loader/mmproj.py): the language model's GGUF as any GGUF, the vision tower and
connector from the mmproj file, images prepared by a processor made from its metadata.

With llama.cpp's converter (convert_hf_to_gguf.py, in ~/.cache/switchyard-peers: the vendored
llama.cpp of the llama-cpp-python sdist and its convert-venv) a tiny random Idefics3 is converted
as a user would convert SmolVLM, and the pair's greedy tokens and log-probabilities must equal the
safetensors checkpoint's. Where the converter is missing (CI) those tests skip, and the mapping is
still covered by mmproj files written with gguf.GGUFWriter in the converter's layout (its names,
metadata keys and tensor types, copied from conversion/smolvlm.py and conversion/base.py's
MmprojModel): every weight read back equals the checkpoint's, and the processor made from the
metadata prepares images as the checkpoint's own. Refusals are one line naming the problem."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from switchyard.core.config import ModelConfig
from switchyard.core.loader import choose_model
from switchyard.core.loader.mmproj import MmprojWeights, read_mmproj
from switchyard.core.models.plain_config import PlainConfig
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.multimodal.idefics3 import Idefics3Family
from switchyard.core.multimodal.family import load_hf_processor
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_vlm import CHAT_TEMPLATE, SPECIALS, hf_greedy_scored, tiny_idefics3
from mmproj_pairs import (CONVERTER, CONVERT_PYTHON, assert_prepares_alike, engine, greedy_answers, image,
                          mmproj_writer, refusal, require_converter)

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
CASES = {"one image": ([None, "what is this?"], [(64, 48, 1)]),
         "text between": (["first", None, "then the second", None, "which?"], [(40, 40, 4), (64, 64, 5)])}


# -- the converter's layout, for files written here -------------------------------------------
def write_mmproj(path: str, hf, processor, tensor_type: str = "f32", **metadata) -> None:
    """`hf`'s vision tower and connector as llama.cpp's converter writes an Idefics3/SmolVLM mmproj
    (conversion/base.py MmprojModel.set_gguf_parameters, conversion/smolvlm.py SmolVLMModel): clip
    metadata, gguf-py's MMPROJ tensor names, 1-D tensors and the embeddings in F32, the other
    matrices in `tensor_type` (f32, f16 or q8_0). `metadata` overrides keys (refusal tests)."""
    import gguf

    vision, image_processor = hf.config.vision_config, processor.image_processor
    tensors = {name: t for name, t in hf.state_dict().items() if "vision_model" in name or "connector" in name}
    tensors.update(metadata.pop("tensors", {}))
    values = {
        "clip.has_vision_encoder": True, "clip.vision.projection_dim": hf.config.text_config.hidden_size,
        "clip.vision.image_size": vision.image_size, "clip.vision.patch_size": vision.patch_size,
        "clip.vision.embedding_length": vision.hidden_size, "clip.vision.feed_forward_length": vision.intermediate_size,
        "clip.vision.block_count": vision.num_hidden_layers, "clip.vision.attention.head_count":
            vision.num_attention_heads, "clip.vision.image_mean": list(image_processor.image_mean),
        "clip.vision.image_std": list(image_processor.image_std), "clip.projector_type": "idefics3",
        "clip.vision.attention.layer_norm_epsilon": vision.layer_norm_eps,
        "clip.vision.projector.scale_factor": hf.config.scale_factor, "clip.use_gelu": True,
        "clip.vision.preproc_image_size": image_processor.size["longest_edge"], **metadata}
    writer = mmproj_writer(path, values)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, tensor in tensors.items():
        stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().numpy()
        if data.ndim == 1 or ".embeddings." in name or tensor_type == "f32":
            writer.add_tensor(stored, data)
        elif tensor_type == "f16":
            writer.add_tensor(stored, data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(stored, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def as_stored(tensor: torch.Tensor, name: str, tensor_type: str) -> torch.Tensor:
    """What the file holds of `tensor` (write_mmproj's types), in float32."""
    import gguf

    if tensor.ndim == 1 or ".embeddings." in name or tensor_type == "f32":
        return tensor.float()
    if tensor_type == "f16":
        return tensor.half().float()
    kind = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), kind), kind)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tensor.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    hf, processor = tiny_idefics3(path)
    return path, hf, processor



# -- the mapping, with files written here (no converter needed) ---------------------------------
@pytest.mark.parametrize("tensor_type", ["f32", "f16", "q8_0"])
def test_every_weight_of_a_converter_layout_mmproj_reads_back_as_the_checkpoints(tiny, tmp_path, tensor_type):
    """The vision config from the clip metadata equals the checkpoint's, and every tensor lands on
    the checkpoint's name with the checkpoint's values as the file stores them."""
    _, hf, processor = tiny
    path = str(tmp_path / f"mmproj-{tensor_type}.gguf")
    write_mmproj(path, hf, processor, tensor_type)
    mmproj = read_mmproj(path)
    vision = hf.config.vision_config
    for key in ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "hidden_act"):
        assert mmproj.vision[key] == getattr(vision, key), key
    assert mmproj.vision["layer_norm_eps"] == pytest.approx(vision.layer_norm_eps)
    assert (mmproj.projector_type, mmproj.scale_factor) == ("idefics3", hf.config.scale_factor)
    config = PlainConfig({"vision_config": PlainConfig(mmproj.vision), "scale_factor": mmproj.scale_factor,
                          "text_config": PlainConfig({"hidden_size": hf.config.text_config.hidden_size})})
    read = dict(MmprojWeights(path, config))
    expected = {n: t for n, t in hf.state_dict().items() if "vision_model" in n or "connector" in n}
    assert sorted(read) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(read[name], as_stored(tensor, name, tensor_type), atol=0, rtol=0, msg=name)


def test_the_processor_made_from_the_metadata_prepares_images_as_the_checkpoints(tiny, tmp_path):
    """Frames and placeholder expansion equal those of the processor saved with the checkpoint."""
    path, hf, processor = tiny
    write_mmproj(str(tmp_path / "mmproj.gguf"), hf, processor)
    config = read_mmproj(str(tmp_path / "mmproj.gguf")).processor_config
    assert config["image_seq_len"] == processor.image_seq_len
    made = Idefics3Family(Idefics3Family.processor_from_config(config, (str(path), None)), hf.config.image_token_id)
    saved = Idefics3Family(load_hf_processor(str(path)), hf.config.image_token_id)
    assert_prepares_alike(made, saved)


# -- refusals: one line, at start, naming the problem -------------------------------------------
@pytest.fixture(scope="module")
def text_gguf(tiny, tmp_path_factory):
    """The tiny model's language model as a GGUF (tests/core/gguf_files.py: no tokenizer; the
    refusals here come before the tokenizer is read)."""
    from gguf_files import write_gguf
    from transformers import LlamaForCausalLM

    _, hf, _ = tiny
    text = LlamaForCausalLM(hf.config.text_config).eval()
    text.model.load_state_dict(hf.model.text_model.state_dict())
    text.lm_head.load_state_dict(hf.lm_head.state_dict())
    path = str(tmp_path_factory.mktemp("text") / "text.gguf")
    write_gguf(text, path)
    return path



def test_a_file_that_is_not_a_gguf_is_refused(text_gguf, tmp_path):
    junk = tmp_path / "mmproj.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    assert "is not a GGUF file" in refusal(text_gguf, str(junk))
    assert "no such file" in refusal(text_gguf, str(tmp_path / "absent.gguf"))


def test_a_gguf_without_a_vision_tower_is_refused(text_gguf):
    assert "not a vision mmproj file (architecture 'llama')" in refusal(text_gguf, text_gguf)


def test_a_projector_type_not_served_is_named(tiny, text_gguf, tmp_path):
    _, hf, processor = tiny
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor, **{"clip.projector_type": "pixtral"})  # Pixtral's
    message = refusal(text_gguf, str(tmp_path / "m.gguf"))
    assert "projector type 'pixtral', which is not served" in message
    assert all(kind in message for kind in ("idefics3", "gemma3", "qwen2vl_merger", "qwen2.5vl_merger"))


def test_a_tower_that_projects_to_another_width_than_the_text_model_is_refused(tiny, text_gguf, tmp_path):
    _, hf, processor = tiny
    wide = torch.zeros(96, hf.model.connector.modality_projection.proj.weight.shape[1])
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor, **{"clip.vision.projection_dim": 96,
                                                             "tensors": {"model.connector.modality_projection."
                                                                         "proj.weight": wide}})
    message = refusal(text_gguf, str(tmp_path / "m.gguf"))
    assert "projects images to width 96" in message and "hidden size 64" in message
    write_mmproj(str(tmp_path / "n.gguf"), hf, processor, **{"clip.vision.projection_dim": None,  # the matrix says
                                                             "tensors": {"model.connector.modality_projection."
                                                                         "proj.weight": wide}})
    assert "projects images to width 96" in refusal(text_gguf, str(tmp_path / "n.gguf"))


def test_tensors_that_do_not_fit_the_metadata_are_refused(tiny, text_gguf, tmp_path):
    _, hf, processor = tiny
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor, **{"clip.vision.block_count": 3})
    assert "tensors missing" in refusal(text_gguf, str(tmp_path / "m.gguf"))
    write_mmproj(str(tmp_path / "n.gguf"), hf, processor, **{"clip.vision.feed_forward_length": 48})
    assert "has shape" in refusal(text_gguf, str(tmp_path / "n.gguf"))


def test_mmproj_goes_with_a_gguf_language_model_only(tiny, tmp_path):
    path, hf, processor = tiny
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor)
    assert "goes with a GGUF language model" in refusal(str(path), str(tmp_path / "m.gguf"))


def test_a_language_model_without_the_image_token_is_refused(tiny, tmp_path):
    """The default model (SmolLM2-135M, hidden 576) has a tokenizer but no <image> token."""
    from switchyard.core.loader.source import ModelNotFoundError, default_model_path

    try:
        text = default_model_path()
    except ModelNotFoundError as missing:
        pytest.skip(f"the default model is not installed: {missing}")
    _, hf, processor = tiny
    wide = torch.zeros(576, hf.model.connector.modality_projection.proj.weight.shape[1])
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor, **{"clip.vision.projection_dim": 576,
                                                             "tensors": {"model.connector.modality_projection."
                                                                         "proj.weight": wide}})
    assert "has no <image> token" in refusal(text, str(tmp_path / "m.gguf"))


def test_the_serve_flag_reaches_the_model_config():
    from switchyard.gateway.cli import build_parser
    from switchyard.gateway.serve import engine_config

    args = build_parser({}).parse_args(["serve", "--model-id", "text.gguf", "--mmproj", "mmproj.gguf"])
    assert engine_config(args).model.mmproj == "mmproj.gguf"
    assert engine_config(build_parser({"MMPROJ": "m.gguf"}).parse_args(["serve"])).model.mmproj == "m.gguf"


# -- llama.cpp's own converter: the pair answers as the checkpoint --------------------------------
def smollm2_vlm_tokenizer():
    """SmolVLM's tokenizer as its checkpoints have it: SmolLM2's (the default model's, whose
    pre-tokenizer llama.cpp's converter knows: "smollm") with Idefics3's special tokens."""
    from transformers import AutoTokenizer

    from switchyard.core.loader.source import ModelNotFoundError, default_model_path

    try:
        gguf_path = default_model_path()
    except ModelNotFoundError as missing:
        pytest.skip(f"the default model, whose tokenizer the converted model takes, is not installed: {missing}")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    tokenizer.eos_token = "<end_of_utterance>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def convert(directory: str, out: str, *flags: str) -> str:
    result = subprocess.run([CONVERT_PYTHON, CONVERTER, directory, "--outfile", out, *flags],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Idefics3 with SmolVLM's tokenizer, converted by llama.cpp: the text GGUF in F32 and
    Q8_0, the mmproj in F32 and F16."""
    require_converter()
    root = tmp_path_factory.mktemp("pair")
    checkpoint = str(root / "checkpoint")
    hf, processor = tiny_idefics3(checkpoint, seed=3, tokenizer=smollm2_vlm_tokenizer())
    # SmolVLM's config.json names its text model's class; the converter picks the text model by it
    with open(os.path.join(checkpoint, "config.json")) as file:
        config = json.load(file)
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    with open(os.path.join(checkpoint, "config.json"), "w") as file:
        json.dump(config, file)
    files = {"text": convert(checkpoint, str(root / "text-f32.gguf"), "--outtype", "f32"),
             "text-q8_0": convert(checkpoint, str(root / "text-q8_0.gguf"), "--outtype", "q8_0"),
             "f32": convert(checkpoint, str(root / "mmproj-f32.gguf"), "--mmproj", "--outtype", "f32"),
             "f16": convert(checkpoint, str(root / "mmproj-f16.gguf"), "--mmproj", "--outtype", "f16")}
    return checkpoint, hf, processor, files, str(root / "cache")



def prompts(processor) -> dict[str, tuple[str, tuple[ImageData, ...]]]:
    """Each case's prompt, rendered by the chat template, and its images."""
    out = {}
    for case, (pieces, sizes) in CASES.items():
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out[case] = text, tuple(image(w, h, seed) for w, h, seed in sizes)
    return out


def answers(engine_core, processor) -> dict[str, tuple[list[int], list[float]]]:
    batch = [Request(case, processor.tokenizer.encode(text, add_special_tokens=False), GREEDY, images=images)
             for case, (text, images) in sorted(prompts(processor).items())]
    return greedy_answers(engine_core, batch)


def hf_answers(hf, processor) -> dict[str, tuple[list[int], list[float]]]:
    from PIL import Image

    out = {}
    for case, (text, images) in prompts(processor).items():
        pictures = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in images]
        inputs = processor(text=text, images=pictures, return_tensors="pt")
        out[case] = hf_greedy_scored(hf, inputs, NUM_TOKENS)
    return out


def assert_same(got: dict, expected: dict) -> None:
    """Equal tokens, and log-probabilities within float32 noise: F16-rounded vision matrices alone
    move them by ~1.6e-4 on these models, so a reference without the rounding fails."""
    assert sorted(got) == sorted(expected)
    for case in expected:
        assert got[case][0] == expected[case][0], case
        torch.testing.assert_close(torch.tensor(got[case][1]), torch.tensor(expected[case][1]), atol=1e-5, rtol=0)


def test_the_converted_pair_answers_as_the_safetensors_checkpoint(converted):
    checkpoint, hf, processor, files, cache = converted
    expected = answers(engine(ModelConfig(model=checkpoint)), processor)
    pair = engine(ModelConfig(model=files["text"], mmproj=files["f32"], cache_dir=cache))
    assert pair.loaded.model.image_token_id == hf.config.image_token_id
    assert pair.loaded.source.mmproj == files["f32"]
    assert_same(answers(pair, processor), expected)


def test_an_f16_mmproj_answers_as_the_checkpoint_with_the_values_it_stores(converted):
    """The converter keeps 1-D tensors and the embeddings in F32 and rounds the other matrices to
    F16 (read from the file): transformers' model with those values is the reference."""
    from gguf import GGUFReader

    _, hf, processor, files, cache = converted
    rounded = {t.name for t in GGUFReader(files["f16"]).tensors if t.tensor_type.name == "F16"}
    assert rounded  # the matrices
    model_config = ModelConfig(model=files["text"], mmproj=files["f16"], cache_dir=cache)
    names = MmprojWeights(files["f16"], choose_model(model_config)[1]).names
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict(hf.state_dict())
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for stored in rounded:
            param = params[names[stored]]
            param.copy_(param.half().float())
    assert_same(answers(engine(model_config), processor), hf_answers(reference, processor))


def test_a_quantized_language_model_stays_packed_and_answers_text_as_served_alone(converted):
    """The language model's Q8_0 blocks come packed (the GGUF path's integer kernels), the tower's
    tensors as floats; a text-only prompt gets the answer of the text GGUF served alone."""
    from switchyard.core.loader import open_weights, plan_load
    from switchyard.core.quant.weight import QuantizedWeight

    _, _, processor, files, cache = converted
    pair_config = ModelConfig(model=files["text-q8_0"], mmproj=files["f16"], cache_dir=cache)
    plan = plan_load(pair_config)
    assert plan.quantize == "gguf"
    kinds = {name: isinstance(weight, QuantizedWeight) for name, weight in open_weights(plan)[0]}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] and kinds["model.layers.1.mlp.down_proj.weight"]
    assert not any(packed for name, packed in kinds.items() if name.startswith(("model.vision_model.",
                                                                                "model.connector.")))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
                                         add_generation_prompt=True)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)

    def answer(model_config: ModelConfig) -> tuple[list[int], list[float]]:
        core = engine(model_config)
        core.add_request(Request("t", ids, GREEDY))
        tokens, logprobs = [], []
        while core.has_unfinished_requests():
            for step in core.step():
                tokens.extend(step.new_token_ids)
                logprobs.extend(step.logprobs or ())
        return tokens, logprobs

    assert answer(pair_config) == answer(ModelConfig(model=files["text-q8_0"], cache_dir=cache))


def test_the_text_gguf_alone_serves_text_as_before(converted):
    """Without --mmproj the language model's GGUF is a text model (llama-server's -m alone)."""
    files, cache = converted[3], converted[4]
    source, _, choice = choose_model(ModelConfig(model=files["text"], cache_dir=cache))
    assert (choice.model_type, source.mmproj) == ("llama", None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
