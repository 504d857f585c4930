"""Gemma 3 served from llama.cpp's GGUF pair (`--model-id gemma-3-XX.gguf --mmproj
mmproj-gemma-3-XX.gguf`, core/loader/mmproj.py, mmproj_projectors.py Gemma3Projector): the vision
tower and projector from the mmproj file, the composite config around the text GGUF's, images
prepared by a Gemma3Processor made from the metadata.

With llama.cpp's converter (as tests/core/test_vision_mmproj.py finds it) a tiny random Gemma 3 is
converted as a user converts Gemma 3: the text GGUF in F32, the mmproj in F32 and F16, and the
pair's greedy tokens and log-probabilities must equal those of the safetensors checkpoint served
by the engine with the values the file stores (the converter writes the input projection in F16
even in an F32 mmproj, and Gemma's soft_emb_norm as 1 + weight). The converter cannot convert the
tiny byte-level tokenizer (a pre-tokenizer it does not know), so that model takes SmolLM2's (the
default model's, which it knows) with Gemma 3's special tokens added.

Where the converter is missing, mmproj files written with gguf.GGUFWriter in the converter's
layout (conversion/gemma.py Gemma3VisionModel, conversion/base.py MmprojModel) still cover the
mapping: every weight read back equals the checkpoint's as the file stores it, and the processor
made from the metadata prepares images as the checkpoint's own. Refusals are one line each."""
from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch

from switchyard.core.config import ModelConfig
from switchyard.core.loader.mmproj import PROJECTORS, MmprojWeights, read_mmproj
from switchyard.core.models.gemma3_vision import Gemma3ForConditionalGeneration
from switchyard.core.models.plain_config import PlainConfig
from switchyard.core.models.vlm import TOWER
from switchyard.core.multimodal.family import load_hf_processor
from switchyard.core.multimodal.gemma3 import Gemma3Family
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_gemma3_vl import CHAT_TEMPLATE, GGUF_TEXT_OPTIONS, tiny_gemma3_vl
from switchyard.core.testing.tiny_vlm import hf_greedy_scored
from mmproj_pairs import (assert_prepares_alike, convert_all, engine, greedy_answers, image, mmproj_writer, refusal,
                          require_converter)

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
CASES = {"one image": [None, "what is this?"],
         "text between": ["first", None, "then the second", None, "which is red?"]}
SIZES = [(50, 40, 1), (20, 30, 2)]
MATRIX = "multi_modal_projector.mm_input_projection_weight"  # [vision hidden, text hidden]
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


# -- the converter's layout, for files written here -------------------------------------------
def checkpoint_name(name: str) -> str:
    """A vision weight's name as the Hub's checkpoints (and the converter) have it."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def vision_weights(hf) -> dict[str, torch.Tensor]:
    return {checkpoint_name(n): t for n, t in hf.state_dict().items()
            if "vision_tower" in n or "multi_modal_projector" in n}


def stored_type(name: str, tensor: torch.Tensor, tensor_type: str) -> str:
    """The converter's type of a tensor (Gemma3VisionModel.tensor_force_quant): the input projection
    F16 always, the embeddings and 1-D tensors F32, the other matrices the output type."""
    if "input_projection" in name:
        return "f16"
    if tensor.ndim == 1 or ".embeddings." in name:
        return "f32"
    return tensor_type


def as_stored(name: str, tensor: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """What a file of `tensor_type` holds of the checkpoint's `tensor`, as our parameter takes it
    back (float32; the norm's +1 undone in float32, as the loader does)."""
    values = tensor.detach().float()
    if "soft_emb_norm" in name:
        return (values + 1.0) - 1.0
    return values.half().float() if stored_type(name, tensor, tensor_type) == "f16" else values


def write_mmproj(path: str, hf, processor, tensor_type: str = "f32", **metadata) -> None:
    """`hf`'s vision tower and projector as llama.cpp's converter writes a Gemma 3 mmproj: clip
    metadata (the scale factor only where it is not 4), gguf-py's MMPROJ names of the checkpoint's
    names ("_weight" as ".weight"), soft_emb_norm stored + 1, the types of `stored_type`.
    `metadata` overrides keys (None: left out; "tensors": replaced tensors)."""
    import gguf

    vision, image_processor = hf.config.vision_config, processor.image_processor
    tensors = vision_weights(hf)
    tensors.update(metadata.pop("tensors", {}))
    side = vision.image_size // vision.patch_size // int(hf.config.mm_tokens_per_image ** 0.5)
    values = {
        "clip.has_vision_encoder": True, "clip.vision.projection_dim": hf.config.text_config.hidden_size,
        "clip.vision.image_size": vision.image_size, "clip.vision.patch_size": vision.patch_size,
        "clip.vision.embedding_length": vision.hidden_size, "clip.vision.feed_forward_length": vision.intermediate_size,
        "clip.vision.block_count": vision.num_hidden_layers,
        "clip.vision.attention.head_count": vision.num_attention_heads,
        "clip.vision.image_mean": list(image_processor.image_mean),
        "clip.vision.image_std": list(image_processor.image_std), "clip.projector_type": "gemma3",
        "clip.vision.attention.layer_norm_epsilon": vision.layer_norm_eps, "clip.use_gelu": True,
        "clip.vision.projector.scale_factor": side if side != 4 else None, **metadata}
    writer = mmproj_writer(path, values)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, tensor in tensors.items():
        stored = names.get_name(name.replace("_weight", ".weight"), try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().numpy() + (1.0 if "soft_emb_norm" in name else 0.0)
        kind = stored_type(name, tensor, tensor_type)
        writer.add_tensor(stored, data.astype(np.float16) if kind == "f16" else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf, processor = tiny_gemma3_vl(path)
    return path, hf, processor



def shape_config(mmproj) -> PlainConfig:
    return PROJECTORS["gemma3"].shape_config(PlainConfig(mmproj.vision), mmproj.scale_factor, mmproj.projection_dim)


# -- the mapping, with files written here (no converter needed) ---------------------------------
@pytest.mark.parametrize("tensor_type", ["f32", "f16"])
def test_every_weight_of_a_converter_layout_mmproj_reads_back_as_the_checkpoints(tiny, tmp_path, tensor_type):
    """The vision config from the clip metadata equals the checkpoint's; every tensor lands on the
    checkpoint's name (one our model takes) with the checkpoint's values as the file stores them."""
    _, hf, processor = tiny
    path = str(tmp_path / f"mmproj-{tensor_type}.gguf")
    write_mmproj(path, hf, processor, tensor_type)
    mmproj = read_mmproj(path)
    vision = hf.config.vision_config
    for key in ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "hidden_act"):
        assert mmproj.vision[key] == getattr(vision, key), key
    assert mmproj.vision["layer_norm_eps"] == pytest.approx(vision.layer_norm_eps)
    assert (mmproj.projector_type, mmproj.projection_dim) == ("gemma3", hf.config.text_config.hidden_size)
    config = shape_config(mmproj)
    assert config.mm_tokens_per_image == hf.config.mm_tokens_per_image
    read = dict(MmprojWeights(path, config))
    expected = vision_weights(hf)
    assert sorted(read) == sorted(expected)
    ours = {n for n, _ in hf.named_parameters()}  # transformers' names are ours, `model.` first
    for name, tensor in expected.items():
        torch.testing.assert_close(read[name], as_stored(name, tensor, tensor_type), atol=0, rtol=0, msg=name)
        part, target = Gemma3ForConditionalGeneration.route(name)
        assert part == TOWER and "model." + target in ours, name
    # the norm is stored + 1 and comes back as the checkpoint's (float32 rounding of the +1 only)
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    torch.testing.assert_close(read[norm], expected[norm], atol=1e-7, rtol=0)


def test_a_file_without_a_scale_factor_pools_by_four(tiny, tmp_path):
    """clip.cpp's default (every Gemma 3 size): 4x4 patches per image token."""
    _, hf, processor = tiny
    path = str(tmp_path / "m.gguf")
    write_mmproj(path, hf, processor, **{"clip.vision.image_size": 128, "clip.vision.projector.scale_factor": None,
                                         "tensors": {"vision_tower.vision_model.embeddings.position_embedding.weight":
                                                     torch.zeros(256, hf.config.vision_config.hidden_size)}})
    mmproj = read_mmproj(path)
    assert mmproj.scale_factor == 4 and mmproj.processor_config["image_seq_length"] == (128 // 8 // 4) ** 2


def test_the_processor_made_from_the_metadata_prepares_images_as_the_checkpoints(tiny, tmp_path):
    """Frames and expanded token ids equal those of the processor saved with the checkpoint."""
    path, hf, processor = tiny
    write_mmproj(str(tmp_path / "mmproj.gguf"), hf, processor)
    config = read_mmproj(str(tmp_path / "mmproj.gguf")).processor_config
    assert config["image_seq_length"] == processor.image_seq_length
    assert config["image_processor"]["resample"] == processor.image_processor.resample == 2  # BILINEAR
    made = Gemma3Family(Gemma3Family.processor_from_config(config, (str(path), None)), hf.config.image_token_id)
    saved = Gemma3Family(load_hf_processor(str(path)), hf.config.image_token_id)
    assert made.placeholder_id == saved.placeholder_id
    assert_prepares_alike(made, saved)


# -- refusals: one line, at start, naming the problem -------------------------------------------
@pytest.fixture(scope="module")
def text_gguf(tiny, tmp_path_factory):
    """The tiny model's language model as a GGUF (tests/core/gguf_files.py: no tokenizer; the
    refusals here come before the tokenizer is read)."""
    from gguf_files import write_gguf
    from transformers import Gemma3ForCausalLM

    _, hf, _ = tiny
    text = Gemma3ForCausalLM(hf.config.text_config).eval()
    text.model.load_state_dict(hf.model.language_model.state_dict())
    path = str(tmp_path_factory.mktemp("text") / "text.gguf")
    write_gguf(text, path)
    return path



def test_tensors_that_do_not_fit_the_metadata_are_refused(tiny, text_gguf, tmp_path):
    _, hf, processor = tiny
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor, **{"clip.vision.block_count": 3})
    assert "does not hold a gemma3 vision tower" in refusal(text_gguf, str(tmp_path / "m.gguf"))
    write_mmproj(str(tmp_path / "n.gguf"), hf, processor, **{"clip.vision.feed_forward_length": 48})
    assert "has shape" in refusal(text_gguf, str(tmp_path / "n.gguf"))
    transposed = vision_weights(hf)[MATRIX].T  # [text hidden, vision hidden]
    write_mmproj(str(tmp_path / "o.gguf"), hf, processor, **{"clip.vision.projection_dim": None,
                                                             "tensors": {MATRIX: transposed}})
    assert "mm.input_projection.weight has shape" in refusal(text_gguf, str(tmp_path / "o.gguf"))
    write_mmproj(str(tmp_path / "p.gguf"), hf, processor, **{"clip.vision.projector.scale_factor": 3})
    assert "scale factor 3 does not divide the 4x4 patch grid" in refusal(text_gguf, str(tmp_path / "p.gguf"))


def test_a_tower_that_projects_to_another_width_than_the_text_model_is_refused(tiny, text_gguf, tmp_path):
    _, hf, processor = tiny
    wide = torch.zeros(hf.config.vision_config.hidden_size, 96)
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor,
                 **{"clip.vision.projection_dim": 96, "tensors": {MATRIX: wide}})
    message = refusal(text_gguf, str(tmp_path / "m.gguf"))
    assert "projects images to width 96" in message and "hidden size 64" in message


def test_a_language_model_without_the_image_soft_token_is_refused(tiny, tmp_path):
    """The default model (SmolLM2-135M, hidden 576) has a tokenizer but no <image_soft_token>."""
    from switchyard.core.loader.source import ModelNotFoundError, default_model_path

    try:
        text = default_model_path()
    except ModelNotFoundError as missing:
        pytest.skip(f"the default model is not installed: {missing}")
    _, hf, processor = tiny
    wide = torch.zeros(hf.config.vision_config.hidden_size, 576)
    write_mmproj(str(tmp_path / "m.gguf"), hf, processor,
                 **{"clip.vision.projection_dim": 576, "tensors": {MATRIX: wide}})
    message = refusal(text, str(tmp_path / "m.gguf"))
    assert "has no <image_soft_token> token" in message and "gemma3 mmproj" in message


# -- llama.cpp's own converter: the pair answers as the checkpoint --------------------------------
def converter_tokenizer(directory: str):
    """SmolLM2's tokenizer (the default model's; llama.cpp's converter knows its pre-tokenizer)
    with Gemma 3's special tokens and chat template."""
    from transformers import AutoTokenizer

    from switchyard.core.loader.source import ModelNotFoundError, default_model_path

    try:
        gguf_path = default_model_path()
    except ModelNotFoundError as missing:
        pytest.skip(f"the default model, whose tokenizer the converted model takes, is not installed: {missing}")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>",
                                                                *GEMMA_TOKENS.values()]})
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory, extra_special_tokens=GEMMA_TOKENS, chat_template=CHAT_TEMPLATE)


def save_hub_layout(checkpoint: str, replace: dict[str, torch.Tensor] | None = None) -> None:
    """The checkpoint's weights under the Hub's names (`vision_tower.vision_model.*`: the converter
    maps those), with `replace` (checkpoint names -> values) written over."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(checkpoint, "model.safetensors")
    weights = {checkpoint_name(name) if name.startswith("vision_tower.") else name: value
               for name, value in load_file(path).items()}
    weights.update(replace or {})
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Gemma 3 with SmolLM2's tokenizer and a text model a GGUF describes (GGUF_TEXT_OPTIONS),
    converted by llama.cpp: the text GGUF in F32, the mmproj in F32 and F16."""
    require_converter()
    root = tmp_path_factory.mktemp("pair")
    checkpoint = str(root / "checkpoint")
    hf, processor = tiny_gemma3_vl(checkpoint, seed=3, tokenizer=converter_tokenizer(str(root / "tokenizer")),
                                   text_options=GGUF_TEXT_OPTIONS)
    save_hub_layout(checkpoint)
    files = {"text": str(root / "text-f32.gguf"), "f32": str(root / "mmproj-f32.gguf"),
             "f16": str(root / "mmproj-f16.gguf")}
    convert_all(checkpoint, {files["text"]: ("--outtype", "f32"), files["f32"]: ("--mmproj", "--outtype", "f32"),
                         files["f16"]: ("--mmproj", "--outtype", "f16")})
    return root, checkpoint, hf, processor, files



def prompts(processor) -> dict[str, tuple[str, tuple[ImageData, ...]]]:
    out = {}
    for case, pieces in CASES.items():
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out[case] = text, tuple(image(*size) for size in SIZES[:pieces.count(None)])
    return out


def answers(engine_core, processor) -> dict[str, tuple[list[int], list[float], list[int]]]:
    """{case: (greedy tokens, their log-probabilities, the expanded prompt ids)}."""
    batch = [Request(case, processor.tokenizer.encode(text, add_special_tokens=False), GREEDY, images=images)
             for case, (text, images) in sorted(prompts(processor).items())]
    out = greedy_answers(engine_core, batch)
    return {r.request_id: (*out[r.request_id], list(r.prompt_token_ids)) for r in batch}


def as_the_file_stores(root, checkpoint: str, hf, mmproj: str, name: str) -> str:
    """A copy of the checkpoint with the vision weights the mmproj file holds (its F16 roundings,
    the norm's +1 and -1 in float32): the reference the pair must equal."""
    import shutil

    from gguf import GGUFReader

    rounded = {t.name for t in GGUFReader(mmproj).tensors if t.tensor_type.name == "F16"}
    assert "mm.input_projection.weight" in rounded  # F16 in every mmproj the converter writes
    copy = str(root / name)
    shutil.copytree(checkpoint, copy)
    weights = vision_weights(hf)
    names = MmprojWeights(mmproj, shape_config(read_mmproj(mmproj))).names
    replace = {parameter: as_stored(parameter, weights[parameter], "f16" if stored in rounded else "f32")
               for stored, parameter in names.items()}
    save_hub_layout(copy, replace)
    return copy


@pytest.mark.parametrize("tensor_type", ["f32", "f16"])
def test_the_converted_pair_answers_as_the_safetensors_checkpoint(converted, tensor_type):
    root, checkpoint, hf, processor, files = converted
    reference = as_the_file_stores(root, checkpoint, hf, files[tensor_type], f"stored-{tensor_type}")
    expected = answers(engine(ModelConfig(model=reference)), processor)
    pair = engine(ModelConfig(model=files["text"], mmproj=files[tensor_type], cache_dir=str(root / "cache")))
    config = pair.loaded.hf_config
    assert (config.model_type, pair.loaded.model.image_token_id) == ("gemma3", hf.config.image_token_id)
    assert (config.boi_token_index, config.eoi_token_index) == (hf.config.boi_token_index, hf.config.eoi_token_index)
    assert config.mm_tokens_per_image == hf.config.mm_tokens_per_image
    got = answers(pair, processor)
    assert sorted(got) == sorted(expected)
    for case in expected:
        assert got[case][2] == expected[case][2], case  # the same expanded prompt ids
        assert got[case][0] == expected[case][0], case
        torch.testing.assert_close(torch.tensor(got[case][1]), torch.tensor(expected[case][1]), atol=1e-5, rtol=0)


def test_the_reference_is_transformers_answer(converted):
    """The engine serving the checkpoint with the F32 file's values answers as transformers does with
    them (the parity above is against a reference that can be wrong only where both are). The
    prompt ids are the engine's: the family's newline merging (core/multimodal/gemma3.py) is
    Gemma's vocabulary's, which SmolLM2's regex pre-tokenizer splits otherwise."""
    from PIL import Image

    root, checkpoint, hf, processor, files = converted
    reference = as_the_file_stores(root, checkpoint, hf, files["f32"], "stored-check")
    model = type(hf)(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    stored = dict(MmprojWeights(files["f32"], shape_config(read_mmproj(files["f32"]))))
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, values in stored.items():
            params["model." + name.replace("vision_tower.vision_model.", "vision_tower.")].copy_(values)
    got = answers(engine(ModelConfig(model=reference)), processor)
    for case, (text, images) in prompts(processor).items():
        pictures = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in images]
        inputs = processor(text=text, images=pictures, return_tensors="pt")
        ids = torch.tensor([got[case][2]])
        assert (ids == hf.config.image_token_id).sum() == (inputs["input_ids"] == hf.config.image_token_id).sum()
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                      token_type_ids=(ids == hf.config.image_token_id).long())
        tokens, logprobs = hf_greedy_scored(model, inputs, NUM_TOKENS)
        assert got[case][0] == tokens, case
        torch.testing.assert_close(torch.tensor(got[case][1]), torch.tensor(logprobs), atol=2e-4, rtol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
