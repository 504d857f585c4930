"""Named model shapes for random ("dummy") weights: `--model-id llama-3-8b --load-format dummy`
or `LLM(model="llama-3-8b", load_format="dummy")` build a model of that real shape with
no download, for benchmarks on machines that cannot fetch weights.

The values are those of each model's published config.json. A synthetic byte-level
tokenizer (`dummy_tokenizer`) goes with them: bytes are ids 0-255 and every other id
reads as "<id>", so prompts encode and sampled ids decode without any vocabulary file.
"""
from __future__ import annotations

from typing import Any

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(  # meta-llama/Meta-Llama-3-8B
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_8K,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE_8K, "factor": 32.0}, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-tiny": dict(  # not a published model: a Llama-3-shaped toy for tests and smoke runs
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def is_named_config(name: str | None) -> bool:
    return name is not None and name.lower() in NAMED_CONFIGS


def named_config(name: str, **overrides: Any) -> Any:
    """The transformers config of a named shape; overrides replace single values
    (tests build scaled-down versions this way)."""
    key = name.lower()
    if key not in NAMED_CONFIGS:
        raise KeyError(f"no named config {name!r}; known: {', '.join(sorted(NAMED_CONFIGS))}")
    from transformers import AutoConfig

    values = {**NAMED_CONFIGS[key], **overrides}
    return AutoConfig.for_model(values.pop("model_type"), **values)


def dummy_tokenizer(vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None) -> Any:
    """A byte-level tokenizer of vocab_size ids with no merges: text encodes to its UTF-8
    bytes (ids 0-255), and an id past those decodes as "<id>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet[:vocab_size])}
    vocab.update({f"<{i}>": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = {}
    if bos_token_id is not None and bos_token_id >= 256:
        special["bos_token"] = f"<{bos_token_id}>"
    if eos_token_id is not None and eos_token_id >= 256:
        special["eos_token"] = f"<{eos_token_id}>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
