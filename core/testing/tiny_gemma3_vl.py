"""A tiny random-weight Gemma 3 vision-language model (transformers' Gemma3ForConditionalGeneration)
with its processor, built offline, for tests of core/models/gemma3_vision.py and its image family.

The tokenizer is a small byte-level BPE with Gemma 3's special tokens (<bos>, <eos>, <pad>,
<start_of_turn>, <end_of_turn>, <start_of_image>, <end_of_image>, <image_soft_token>) and, as
Gemma's vocabulary has, one token for each run of newlines ("\\n" to "\\n" * 8, matched longest
first), so "\\n" + "\\n\\n" tokenizes as one token when written together, as with the real one; its
chat template writes <start_of_image> for an image part, as Gemma 3's does. The image processor
makes one 32x32 frame (SigLIP patches of 8: a 4x4 grid), which the projector pools to 4 image
tokens. The text model has a sliding-window layer and a global one (SLIDING_WINDOW)."""
from __future__ import annotations

from .tiny_vlm import byte_bpe

CORPUS = ["what is in this picture? a red square on a blue field.",
          "Describe the image. It shows two cats and a dog in the garden.",
          "first then the second which is red? compare them. look at it",
          "The quick brown fox jumps over the lazy dog. Numbers 0123456789."] * 20

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"]
NEWLINES = ["\n" * n for n in range(1, 9)]  # Gemma's vocabulary has a token for each run of newlines
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 32, 8, 4
SLIDING_WINDOW = 32
# a text model a gemma3 GGUF describes as the checkpoint does: llama.cpp's fixed layer pattern (every
# sixth layer global, so two sliding layers) and no query_pre_attn_scalar key (head_dim it is, 256
# where the GGUF is read back, as in Gemma 3 1B-12B)
GGUF_TEXT_OPTIONS = {"layer_types": ["sliding_attention", "sliding_attention"], "head_dim": 256,
                     "query_pre_attn_scalar": 256}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def tiny_tokenizer(vocab_size: int = 320):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_bpe(CORPUS, SPECIALS, vocab_size)
    tokenizer.add_tokens([AddedToken(run, normalized=False, special=False) for run in NEWLINES])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
        chat_template=CHAT_TEMPLATE)


def tiny_gemma3_vl(path, seed: int = 1, tokenizer=None, text_options: dict | None = None):
    """Saves a tiny Gemma 3 vision-language checkpoint and its processor under `path`; returns
    (hf model, processor). `tokenizer`: one with Gemma 3's image tokens (boi_token, eoi_token,
    image_token) in place of the tiny one (a tokenizer llama.cpp's converter knows:
    tests/core/test_vision_mmproj_gemma3.py); `text_options`: text config entries in place of the
    defaults (a text model a GGUF can describe: GGUF_TEXT_OPTIONS)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Gemma3Processor(image_processor, tokenizer, image_seq_length=TOKENS_PER_IMAGE,
                                chat_template=CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"), tie_word_embeddings=True,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                           vision_use_head=False, layer_norm_eps=1e-6),
        text_config={**dict(model_type="gemma3_text", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                            sliding_window=SLIDING_WINDOW, max_position_embeddings=512, rms_norm_eps=1e-6,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True), **(text_options or {})})
    torch.manual_seed(seed)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random weights big enough that images, and how they are attended, change the answer
        for name, param in hf.named_parameters():  # small tied embeddings: a head that does not echo its input
            param.normal_(0.0, 0.05 if "embed_tokens" in name else 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return hf, processor
