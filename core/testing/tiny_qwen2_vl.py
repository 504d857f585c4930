"""A tiny random-weight Qwen2-VL (or Qwen2.5-VL) with its processor, built offline, for tests of the
Qwen2-VL path (core/models/qwen2_vl.py, qwen2_vision.py, qwen2_5_vision.py, core/multimodal/qwen2_vl.py).

The tokenizer is a small byte-level BPE with Qwen's special tokens (<|im_start|>, <|im_end|>,
<|vision_start|>, <|image_pad|>, <|vision_end|>, <|endoftext|>) and a Qwen2-VL-style chat
template (an image part is `<|vision_start|><|image_pad|><|vision_end|>`); the image processor
(the PIL one) keeps images between 28*28 and 28*28*8 pixels, so a small test image gives 1 to 8
image tokens (a 28-pixel cell each, after the 2x2 merge).

transformers' Qwen2VLProcessor needs its video processor, which needs torchvision (not installed):
the checkpoint's tokenizer and image processor are saved each on its own, as the engine loads them
(core/multimodal/qwen2_vl.py), and tests expand the prompt with `processor_inputs`."""
from __future__ import annotations

from .tiny_vlm import CORPUS, byte_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
            "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen_tokenizer(vocab_size: int = 300):
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_bpe(CORPUS, SPECIALS, vocab_size)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:], chat_template=CHAT_TEMPLATE)


VISION = {  # tiny towers: patch 14, temporal patch 2, 2x2 merge, width 32, 2 heads
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    # window attention over 2x2 merge units (56 pixels), block 1 full
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                       window_size=56, fullatt_block_indexes=[1]),
}


def tiny_qwen2_vl(path, seed: int = 1, family: str = "qwen2_vl", tokenizer=None, vision: dict | None = None,
                  pixels: tuple[int, int] = (28 * 28, 28 * 28 * 8)):
    """Saves a tiny Qwen2-VL (or, `family="qwen2_5_vl"`, Qwen2.5-VL) checkpoint, its tokenizer and
    image processor under `path`; returns (hf model, tokenizer, image processor).
    Text: hidden 64, 4 heads of 16 (mrope_section [2, 3, 3] sums to 16 / 2), 2 KV heads, 2 layers;
    vision: VISION[family], updated with `vision`. `tokenizer`: one with Qwen's special tokens in
    place of the tiny one (a tokenizer llama.cpp's converter knows:
    tests/core/test_vision_mmproj_qwen2_vl.py); `pixels`: the image processor's (min, max) pixels."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tokenizer if tokenizer is not None else tiny_qwen_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1])
    ids = tokenizer.convert_tokens_to_ids
    config_class, model_class = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
                                 "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}[family]
    config = getattr(transformers, config_class)(
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        vision_config={**VISION[family], **(vision or {}), "patch_size": 14, "temporal_patch_size": 2,
                       "spatial_merge_size": 2},
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False))
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random weights big enough that images and positions change the answer
        for name, param in hf.named_parameters():
            if "norm" in name or "ln_q" in name:  # norms near 1: logits far from uniform
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    return hf, tokenizer, image_processor


def processor_inputs(tokenizer, image_processor, text: str, images: list) -> dict:
    """What Qwen2VLProcessor gives transformers' model for `text` (a rendered prompt) and PIL
    `images`: each `<|image_pad|>` repeated t*h*w / merge_size**2 times, the pixel values, the
    image grids, and mm_token_type_ids (1 on image tokens)."""
    import torch

    pad = "<|image_pad|>"
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1, "one <|image_pad|> per image"
    out = image_processor(images=images, return_tensors="pt") if images else {}
    grids = out["image_grid_thw"].tolist() if images else []
    expanded = pieces[0] + "".join(pad * (t * h * w // image_processor.merge_size ** 2) + piece
                                   for (t, h, w), piece in zip(grids, pieces[1:]))
    input_ids = torch.tensor([tokenizer.encode(expanded, add_special_tokens=False)])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "mm_token_type_ids": (input_ids == tokenizer.convert_tokens_to_ids(pad)).int()}
    if images:
        inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    return inputs
