"""A tiny random-weight Idefics3 (SmolVLM's architecture) with its processor, built offline, for
tests of the vision path (core/multimodal) and of a backend's vision encoders.

The tokenizer is a small byte-level BPE with Idefics3's special tokens (<image>,
<fake_token_around_image>, <global-img>, <row_i_col_j>, <end_of_utterance>) and SmolVLM's chat
template; the image processor splits an image into 32x32 tiles (4 image tokens each after the
pixel shuffle) plus a global image, so small test images exercise the tiled prompt layout."""
from __future__ import annotations

import io

CORPUS = ["User: what is in this picture? Assistant: a red square on a blue field.",
          "Describe the image. It shows two cats and a dog in the garden.",
          "The quick brown fox jumps over the lazy dog. Numbers 0123456789."] * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
            "<global-img>"] + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]

CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def byte_bpe(corpus: list[str], specials: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus`, `specials` first in its vocabulary:
    the tiny test models' tokenizers, each family's wrapped with its own special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def tiny_tokenizer(vocab_size: int = 300):
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_bpe(CORPUS, SPECIALS, vocab_size)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<end_of_utterance>",
                                   pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                   additional_special_tokens=SPECIALS[2:], chat_template=CHAT_TEMPLATE)


def tiny_idefics3(path, seed: int = 1, family: str = "idefics3", tokenizer=None):
    """Saves a tiny Idefics3 (or, `family="smolvlm"`, SmolVLM: the same architecture under its own
    classes) checkpoint and its processor under `path`; returns (hf model, processor). The processor
    is Idefics3's for both: SmolVLM's own needs `num2words` and a video processor, and expands a
    single image the same way. `tokenizer`: one with Idefics3's special tokens (SPECIALS) in place
    of the tiny one (the vocabulary is its size)."""
    import torch
    import transformers
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config_class, model_class = {"idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
                                 "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration")}[family]
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                do_image_splitting=True)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE)
    vocab = len(tokenizer)
    config = getattr(transformers, config_class)(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         tie_word_embeddings=False, rms_norm_eps=1e-5))
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random weights big enough that images change the answer
        for param in hf.parameters():
            param.normal_(0.0, 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return hf, processor


def png_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A noisy RGB image, encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def hf_greedy_scored(hf, inputs, num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate` on a processor's `inputs`: (the new tokens, each one's
    log-probability), what the vision tests compare the engine's with."""
    import torch

    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
