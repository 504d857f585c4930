"""Qwen2-VL and Qwen2.5-VL served from llama.cpp's GGUF pair (`--model-id Qwen2-VL-XX.gguf --mmproj
mmproj-Qwen2-VL-XX.gguf`, core/loader/mmproj.py, mmproj_qwen2_vl.py): the vision tower from the
mmproj file (the converter's split qkv and Conv3d patch embedding put back together), the
composite config around the text GGUF's (llama.cpp's "qwen2vl" architecture, read as Qwen2 with
its M-RoPE sections: core/loader/gguf_weights.py vision_text_config), images prepared by a
Qwen2VLImageProcessor made from the metadata.

Where llama.cpp's converter is missing, mmproj files written with gguf.GGUFWriter in the
converter's layout (conversion/qwenvl.py Qwen2VLVisionModel, conversion/base.py MmprojModel) cover
the mapping: every weight read back equals the checkpoint's as the file stores it (F32, F16), and
the processor made from the metadata prepares images as the checkpoint's own. Refusals are one
line each.

With the converter (tests/core/mmproj_pairs.py finds it) a tiny random Qwen2-VL and Qwen2.5-VL are
converted as a user converts them: the text GGUF in F32, the mmproj in F32 and F16; the pair's
greedy tokens and log-probabilities must equal those of the safetensors checkpoint served by the
engine with the values the file stores (its F16 roundings). The converter cannot convert the tiny
byte-level tokenizer (a pre-tokenizer it does not know): the model takes SmolLM2's (the default
model's, whose hash the converter knows) with Qwen's special tokens added. The tiny towers differ
from the default tiny ones where the converter or the file needs it: Qwen2-VL with 3 blocks (gguf-py's
table names the merger's mm.2 only for a tower of 3 blocks or more) and an MLP ratio of 3 (its fc1
width is not the feed_forward_length the converter writes); Qwen2.5-VL with clip.cpp's window of
112 pixels (the converter writes none), and the checkpoints' min/max pixels (the converter writes
none either)."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

from switchyard.core.config import ModelConfig
from switchyard.core.loader.mmproj import PROJECTORS, MmprojWeights, read_mmproj
from switchyard.core.loader.mmproj_qwen2_vl import MAX_PIXELS, MIN_PIXELS
from switchyard.core.models.plain_config import PlainConfig
from switchyard.core.models.qwen2_vl import Qwen2VLForConditionalGeneration
from switchyard.core.models.vlm import TOWER
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.multimodal.qwen2_vl import Qwen2VLFamily
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.tiny_qwen2_vl import CHAT_TEMPLATE, SPECIALS, tiny_qwen2_vl
from mmproj_pairs import (assert_prepares_alike, convert_all, engine, greedy_answers, image, mmproj_writer, refusal,
                          require_converter)

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
CASES = {"one image": [None, "what is this?"],
         "text between": ["first", None, "then the second", None, "which is red?"]}
SIZES = [(50, 40, 1), (150, 120, 2)]  # the second spans two of Qwen2.5-VL's 112-pixel windows
TYPES = {"qwen2_vl": "qwen2vl_merger", "qwen2_5_vl": "qwen2.5vl_merger"}
# the towers as the converter and the file can hold them (the module's docstring)
WRITTEN = {"qwen2_vl": {"depth": 3, "mlp_ratio": 3}, "qwen2_5_vl": {}}
CONVERTED = {"qwen2_vl": {"depth": 3, "mlp_ratio": 3}, "qwen2_5_vl": {"window_size": 112}}
PATCH = "visual.patch_embed.proj.weight"


# -- the converter's layout, for files written here -------------------------------------------
def vision_weights(hf) -> dict[str, torch.Tensor]:
    """The tower's weights under the original checkpoints' names (`visual.*`, the converter's)."""
    return {name.removeprefix("model."): tensor for name, tensor in hf.state_dict().items() if "visual." in name}


def stored(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The converter's tensors of one checkpoint tensor (Qwen2VLVisionModel.modify_tensors):
    (the name it looks up in gguf-py's table, or the file's name for the patch kernels; values)."""
    if ".attn.qkv." in name:
        return [(name.replace(".qkv.", f".{part}."), rows) for part, rows in zip("qkv", tensor.chunk(3, dim=0))]
    if name == PATCH:
        return [("v.patch_embd.weight", tensor[:, :, 0]), ("v.patch_embd.weight.1", tensor[:, :, 1])]
    return [(name, tensor)]


def as_stored(tensor: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """What a file of `tensor_type` holds of `tensor`: F16 for every matrix of an F16 file (the
    patch kernels too), F32 for the rest."""
    values = tensor.detach().float()
    return values.half().float() if tensor_type == "f16" and values.ndim > 1 else values


def write_mmproj(path: str, hf, image_processor, tensor_type: str = "f32", **metadata) -> None:
    """`hf`'s vision tower as llama.cpp's converter writes it: clip metadata with its renames (a
    Qwen2-VL's embed_dim as embedding_length, its hidden_size as feed_forward_length; Qwen2.5-VL's
    fullatt_block_indexes as n_wa_pattern, clip.use_silu), the split tensors, gguf-py's names.
    `metadata` overrides keys (None: left out; "tensors": {file name: values} written over,
    "drop": file names left out)."""
    import gguf

    vision, qwen25 = hf.config.vision_config, hf.config.model_type == "qwen2_5_vl"
    replaced, drop = metadata.pop("tensors", {}), metadata.pop("drop", ())
    values = {
        "clip.has_vision_encoder": True, "clip.vision.projection_dim": hf.config.text_config.hidden_size,
        "clip.vision.image_size": 560, "clip.vision.patch_size": vision.patch_size,
        "clip.vision.embedding_length": vision.hidden_size if qwen25 else vision.embed_dim,
        "clip.vision.feed_forward_length": vision.intermediate_size if qwen25 else vision.hidden_size,
        "clip.vision.block_count": vision.depth, "clip.vision.attention.head_count": vision.num_heads,
        "clip.vision.image_mean": list(image_processor.image_mean),
        "clip.vision.image_std": list(image_processor.image_std), "clip.projector_type": TYPES[hf.config.model_type],
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        **({"clip.use_silu": True, "clip.vision.n_wa_pattern": vision.fullatt_block_indexes[0] + 1,
            "clip.vision.window_size": vision.window_size} if qwen25 else {}), **metadata}
    writer = mmproj_writer(path, values)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    for name, tensor in vision_weights(hf).items():
        for looked_up, part in stored(name, tensor):
            file_name = names.get_name(looked_up, try_suffixes=(".weight", ".bias")) or looked_up
            if file_name in drop:
                continue
            data = replaced.get(file_name, part).detach().float().numpy()
            writer.add_tensor(file_name, data.astype(np.float16) if tensor_type == "f16" and data.ndim > 1 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(TYPES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, tokenizer, image_processor = tiny_qwen2_vl(path, family=request.param, vision=WRITTEN[request.param])
    return path, hf, tokenizer, image_processor


def shape_config(mmproj) -> PlainConfig:
    return PROJECTORS[mmproj.projector_type].shape_config(PlainConfig(mmproj.vision), mmproj.scale_factor,
                                                          mmproj.projection_dim)


# -- the mapping, with files written here (no converter needed) ---------------------------------
@pytest.mark.parametrize("tensor_type", ["f32", "f16"])
def test_every_weight_of_a_converter_layout_mmproj_reads_back_as_the_checkpoints(tiny, tmp_path, tensor_type):
    """The vision config from the clip metadata equals the checkpoint's; every parameter (the split
    ones put back together) lands on the checkpoint's name with the values the file stores."""
    _, hf, _, image_processor = tiny
    path = str(tmp_path / f"mmproj-{tensor_type}.gguf")
    write_mmproj(path, hf, image_processor, tensor_type)
    mmproj = read_mmproj(path)
    vision = hf.config.vision_config
    keys = {"qwen2_vl": ("depth", "embed_dim", "hidden_size", "num_heads", "mlp_ratio", "hidden_act"),
            "qwen2_5_vl": ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads", "hidden_act",
                           "window_size", "fullatt_block_indexes")}[hf.config.model_type]
    for key in keys + ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels"):
        assert mmproj.vision[key] == getattr(vision, key), key
    assert (mmproj.projector_type, mmproj.projection_dim) == (TYPES[hf.config.model_type],
                                                              hf.config.text_config.hidden_size)
    read = dict(MmprojWeights(path, shape_config(mmproj)))
    expected = vision_weights(hf)
    assert sorted(read) == sorted(expected)
    ours = {n for n, _ in hf.named_parameters()}  # transformers' names: `model.visual.*`
    for name, tensor in expected.items():
        torch.testing.assert_close(read[name], as_stored(tensor, tensor_type), atol=0, rtol=0, msg=name)
        part, target = Qwen2VLForConditionalGeneration.route(name)
        assert part == TOWER and "model." + target in ours, name


def test_qwen2_5_vl_window_attention_defaults_to_clip_cpps(tiny, tmp_path):
    """A Qwen2.5-VL file without clip.vision.window_size (the converter writes none): 112 pixels;
    full attention in every n_wa_pattern-th block."""
    _, hf, _, image_processor = tiny
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2.5-VL's window attention")
    path = str(tmp_path / "m.gguf")
    write_mmproj(path, hf, image_processor, **{"clip.vision.window_size": None, "clip.vision.block_count": 3,
                                               "clip.vision.n_wa_pattern": 1})
    vision = read_mmproj(path).vision
    assert (vision["window_size"], vision["fullatt_block_indexes"]) == (112, [0, 1, 2])


def test_the_processor_made_from_the_metadata_prepares_images_as_the_checkpoints(tiny, tmp_path):
    """Frames and expansions equal those of the checkpoint's image processor: with the file's
    clip.vision.image_min_pixels / image_max_pixels, and without them (the Qwen checkpoints')."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path, hf, _, image_processor = tiny
    image_token_id = hf.config.image_token_id
    saved = Qwen2VLFamily(Qwen2VLFamily.load_processor(str(path)), image_token_id)
    write_mmproj(str(tmp_path / "m.gguf"), hf, image_processor, **{
        "clip.vision.image_min_pixels": image_processor.size["shortest_edge"],
        "clip.vision.image_max_pixels": image_processor.size["longest_edge"]})
    config = read_mmproj(str(tmp_path / "m.gguf")).processor_config
    assert config["image_processor"]["resample"] == image_processor.resample == 3  # BICUBIC
    made = Qwen2VLFamily(Qwen2VLFamily.processor_from_config(config, (str(path), None)), image_token_id)
    assert made.placeholder_id == saved.placeholder_id
    assert_prepares_alike(made, saved)
    write_mmproj(str(tmp_path / "n.gguf"), hf, image_processor)
    config = read_mmproj(str(tmp_path / "n.gguf")).processor_config
    assert (config["image_processor"]["min_pixels"], config["image_processor"]["max_pixels"]) == (MIN_PIXELS,
                                                                                                  MAX_PIXELS)
    hub = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=image_processor.image_mean,
                                   image_std=image_processor.image_std)
    assert_prepares_alike(Qwen2VLFamily(Qwen2VLFamily.processor_from_config(config, (str(path), None)), image_token_id),
                          Qwen2VLFamily(hub, image_token_id))


# -- refusals: one line, at start, naming the problem -------------------------------------------
@pytest.fixture(scope="module")
def text_gguf(tiny, tmp_path_factory):
    """A Qwen2 language model of the tiny one's shape as a GGUF (tests/core/gguf_files.py: no
    tokenizer; the refusals here come before the tokenizer is read)."""
    from gguf_files import write_gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, hf, _, _ = tiny
    text = hf.config.text_config
    config = Qwen2Config(vocab_size=text.vocab_size, hidden_size=text.hidden_size,
                         intermediate_size=text.intermediate_size, num_hidden_layers=text.num_hidden_layers,
                         num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads)
    path = str(tmp_path_factory.mktemp("text") / "text.gguf")
    write_gguf(Qwen2ForCausalLM(config).eval(), path)
    return path


def test_files_that_do_not_fit_are_refused(tiny, text_gguf, tmp_path):
    _, hf, _, image_processor = tiny
    kind = TYPES[hf.config.model_type]
    vision = hf.config.vision_config
    merged = vision_weights(hf)["visual.merger.mlp.2.weight"].shape[1]  # the merger's input: 4 patches
    cases = [({"clip.vision.patch_size": None}, "lacks clip.vision.patch_size"),
             ({"clip.vision.block_count": vision.depth + 1}, f"does not hold a {kind} vision tower"),
             ({"drop": ("v.patch_embd.weight.1",)}, "1 tensors missing (e.g. ['v.patch_embd.weight.1'])"),
             ({"drop": ("v.blk.0.attn_k.bias",)}, "1 tensors missing (e.g. ['v.blk.0.attn_k.bias'])"),
             ({"tensors": {"v.blk.1.attn_v.weight": torch.zeros(8, 8)}}, "tensor v.blk.1.attn_v.weight has shape [8, 8]"),
             ({"clip.vision.projection_dim": 96, "tensors": {"mm.2.weight": torch.zeros(96, merged),
                                                             "mm.2.bias": torch.zeros(96)}},
              "projects images to width 96")]
    if kind == "qwen2.5vl_merger":
        cases += [({"clip.vision.n_wa_pattern": None}, "lacks clip.vision.n_wa_pattern"),
                  ({"clip.use_silu": None}, "a quick-GELU vision MLP (neither clip.use_gelu nor clip.use_silu) is not "
                                            "served for qwen2.5vl_merger")]
    else:
        cases += [({"clip.use_silu": True}, "a SiLU vision MLP (clip.use_silu) is not served for qwen2vl_merger"),
                  ({"drop": ("v.blk.0.ffn_up.weight",)}, "no v.blk.0.ffn_up.weight or mm.2.weight tensor")]
    for index, (metadata, expected) in enumerate(cases):
        path = str(tmp_path / f"m{index}.gguf")
        write_mmproj(path, hf, image_processor, **metadata)
        assert expected in refusal(text_gguf, path), (metadata, expected)


# -- llama.cpp's own converter: the pair answers as the checkpoint --------------------------------
def converter_tokenizer(directory: str):
    """SmolLM2's tokenizer (the default model's; llama.cpp's converter knows its pre-tokenizer)
    with Qwen's special tokens and the tiny chat template."""
    from transformers import AutoTokenizer

    from switchyard.core.loader.source import ModelNotFoundError, default_model_path

    try:
        gguf_path = default_model_path()
    except ModelNotFoundError as missing:
        pytest.skip(f"the default model, whose tokenizer the converted model takes, is not installed: {missing}")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in SPECIALS if t not in tokenizer.get_vocab()]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def converter_shared(tmp_path_factory):
    """What both families' pairs share: the tokenizer the converter knows, and one cache directory
    for the engines serving the pairs (the text GGUFs' converted metadata, the CPU kernels built
    once)."""
    require_converter()
    root = tmp_path_factory.mktemp("shared")
    return converter_tokenizer(str(root / "tokenizer")), str(root / "cache")


@pytest.fixture(scope="module", params=sorted(TYPES))
def converted(request, tmp_path_factory, converter_shared):
    """A tiny Qwen2-VL or Qwen2.5-VL with SmolLM2's tokenizer and the Qwen checkpoints' min/max
    pixels, converted by llama.cpp: the text GGUF in F32, the mmproj in F32 and F16."""
    tokenizer, cache = converter_shared
    root = tmp_path_factory.mktemp(f"pair-{request.param}")
    checkpoint = str(root / "checkpoint")
    hf, tokenizer, _ = tiny_qwen2_vl(checkpoint, seed=3, family=request.param, vision=CONVERTED[request.param],
                                     tokenizer=tokenizer, pixels=(MIN_PIXELS, MAX_PIXELS))
    files = {"text": str(root / "text-f32.gguf"), "f32": str(root / "mmproj-f32.gguf"),
             "f16": str(root / "mmproj-f16.gguf")}
    convert_all(checkpoint, {files["text"]: ("--outtype", "f32"), files["f32"]: ("--mmproj", "--outtype", "f32"),
                         files["f16"]: ("--mmproj", "--outtype", "f16")})
    return root, checkpoint, hf, tokenizer, files, cache


def prompts(tokenizer) -> dict[str, tuple[str, tuple[ImageData, ...]]]:
    out = {}
    for case, pieces in CASES.items():
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        out[case] = text, tuple(image(*size) for size in SIZES[:pieces.count(None)])
    return out


def answers(engine_core, tokenizer) -> dict[str, tuple[list[int], list[float], list[int]]]:
    """{case: (greedy tokens, their log-probabilities, the expanded prompt ids)}."""
    batch = [Request(case, tokenizer.encode(text, add_special_tokens=False), GREEDY, images=images)
             for case, (text, images) in sorted(prompts(tokenizer).items())]
    out = greedy_answers(engine_core, batch)
    return {r.request_id: (*out[r.request_id], list(r.prompt_token_ids)) for r in batch}


def as_the_file_stores(root, checkpoint: str, mmproj: str, name: str) -> str:
    """A copy of the checkpoint with the vision weights the mmproj file holds (its F16 roundings):
    the reference the pair must equal."""
    from safetensors.torch import load_file, save_file

    copy = str(root / name)
    shutil.copytree(checkpoint, copy)
    weights = load_file(os.path.join(copy, "model.safetensors"))
    stored_values = dict(MmprojWeights(mmproj, shape_config(read_mmproj(mmproj))))
    assert set(stored_values) <= set(weights)
    weights.update(stored_values)
    save_file(weights, os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("tensor_type", ["f32", "f16"])
def test_the_converted_pair_answers_as_the_safetensors_checkpoint(converted, tensor_type):
    root, checkpoint, hf, tokenizer, files, cache = converted
    if tensor_type == "f16":  # the converter's F16 file rounds the matrices, the patch kernels too
        from gguf import GGUFReader

        kinds = {t.tensor_type.name for t in GGUFReader(files["f16"]).tensors if t.name == "v.patch_embd.weight"}
        assert kinds == {"F16"}
    reference = as_the_file_stores(root, checkpoint, files[tensor_type], f"stored-{tensor_type}")
    expected = answers(engine(ModelConfig(model=reference)), tokenizer)
    pair = engine(ModelConfig(model=files["text"], mmproj=files[tensor_type], cache_dir=cache))
    config = pair.loaded.hf_config
    assert (config.model_type, pair.loaded.model.image_token_id) == (hf.config.model_type, hf.config.image_token_id)
    assert list(config.text_config.rope_parameters["mrope_section"]) == [2, 3, 3]
    assert (config.vision_start_token_id, config.vision_end_token_id) == (hf.config.vision_start_token_id,
                                                                           hf.config.vision_end_token_id)
    got = answers(pair, tokenizer)
    assert sorted(got) == sorted(expected)
    for case in expected:
        assert got[case][2] == expected[case][2], case  # the same expanded prompt ids
        assert got[case][0] == expected[case][0], case
        torch.testing.assert_close(torch.tensor(got[case][1]), torch.tensor(expected[case][1]), atol=1e-5, rtol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
