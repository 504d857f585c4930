"""A tiny Llama for the real quantization tools (tests/quant_tools/), made here from nothing: a
byte-level BPE tokenizer trained on TEXTS, and a Llama (hidden 256, 2 layers) from a random
initialisation trained for a few seconds on the same TEXTS, saved in bfloat16 as Hub models are.

Why trained at all: on a purely random model the two largest logits are often closer than the
CPU kernels' rounding (tests/core/test_hub_quant.py measured 0.003-0.07 apart at the closest of
16 greedy steps), so equal greedy tokens would test luck. A model that has learnt TEXTS continues
them with margins of 7 or more between its two largest logits, quantized or not. The tools
calibrate on TEXTS too: the inputs the model was trained on.
"""
from __future__ import annotations

import os

import torch

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A small model can still learn to repeat a few short sentences by heart.",
    "Quantized weights keep four bits per value and one scale for each group.",
    "The engine schedules requests, runs the model and samples the next token.",
    "Rain fell all night, and by morning the streets were quiet and clean.",
    "She counted one, two, three, four, five, six, seven, eight, nine, ten.",
    "Bread, butter, cheese and apples were laid out on the wooden table.",
]
# Prompts whose greedy continuations are compared: beginnings of TEXTS, continued with margins of 7
# or more between the two largest logits (a prompt the model never saw can have 0.1).
PROMPTS = ["The quick brown fox", "Paris is the capital", "She counted one, two,", "Quantized weights keep"]
VOCAB_SIZE = 384
SEED = 0


def build_tokenizer(path: str):
    """A byte-level BPE tokenizer trained on TEXTS (deterministic), saved under path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXTS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def llama_config(vocab_size: int):
    from transformers import LlamaConfig

    # in features 256 and 512: several groups of 32 and 128 in every row; out features multiples of 64
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                       tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       rms_norm_eps=1e-5, rope_theta=10000.0)


def build_float_model(path: str, steps: int = 150) -> str:
    """The tokenizer and the trained model, saved under path in bfloat16 (safetensors). Returns path."""
    from transformers import LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(path)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(len(tokenizer))).float()
    batch = tokenizer([text + tokenizer.eos_token for text in TEXTS], padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and no faster with more for this size
    try:
        model.train()
        for _ in range(steps):
            loss = model(**batch, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(before)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def calibration_ids(tokenizer) -> list[list[int]]:
    """TEXTS as the tools calibrate on them: token ids with the bos token."""
    return [tokenizer(text)["input_ids"] for text in TEXTS]
