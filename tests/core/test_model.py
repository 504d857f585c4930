"""The pure-torch Llama family against Hugging Face transformers, on tiny random
models, through load_model and a ragged flat batch with a chunked prompt."""
from __future__ import annotations

import json

import pytest
import torch
from model_helpers import ReferenceBackend, assert_two_steps_match, ragged_prompts, run_two_steps, save_tiny
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from switchyard.core.config import ModelConfig
from switchyard.core.layers.rotary import compute_inv_freq, rope_parameters
from switchyard.core.loader import load_model

BLOCK_SIZE = 4
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu", eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def tiny_configs() -> dict:
    return {
        # llama3 rope scaling, separate lm_head, q/k/v/o and MLP biases
        "llama": LlamaConfig(**SMALL, rope_theta=500.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
                             attention_bias=True, mlp_bias=True),
        # q/k/v bias, tied embeddings, a sliding window on layer 1 only
        "qwen2": Qwen2Config(**SMALL, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                             max_window_layers=1),
        # per-head q/k norms and a head_dim that is not hidden_size / num_heads
        "qwen3": Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=False),
        # a sliding window on every layer
        "mistral": MistralConfig(**SMALL, sliding_window=5, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module", params=sorted(tiny_configs()))
def saved_model(request, tmp_path_factory):
    config = tiny_configs()[request.param]
    path = tmp_path_factory.mktemp(request.param)
    # Shard the llama checkpoint so the index file is exercised.
    hf = save_tiny(config, path, max_shard_size="100KB" if request.param == "llama" else "1GB")
    if request.param == "llama":  # generation_config.json's eos wins over config.json's
        generation = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [3, 4]}))
    return request.param, str(path), hf


def prompts() -> dict[str, list[int]]:
    return ragged_prompts(128)


def test_matches_transformers_on_a_ragged_chunked_batch(saved_model):
    _, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path), ReferenceBackend(), BLOCK_SIZE)
    assert_two_steps_match(loaded, hf, prompts(), decode_token=11, block_size=BLOCK_SIZE)


def test_loaded_model_fields(saved_model):
    arch, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path, max_model_len=32), ReferenceBackend(), BLOCK_SIZE)
    assert not loaded.model.training
    assert loaded.num_layers == 2 and loaded.max_model_len == 32 and loaded.vocab_size == 128
    spec = loaded.attention_spec
    assert (spec.num_heads, spec.num_kv_heads, spec.block_size, spec.dtype) == (4, 2, BLOCK_SIZE, torch.float32)
    assert spec.head_dim == (24 if arch == "qwen3" else 16)
    windows = [s.sliding_window for s in loaded.attention_specs]
    assert windows == {"qwen2": [None, 4], "mistral": [5, 5]}.get(arch, [None, None])
    assert loaded.eos_token_ids == ((3, 4) if arch == "llama" else (2,))
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == (arch == "qwen2")
    with pytest.raises(ValueError, match="exceeds"):
        load_model(ModelConfig(model=path, max_model_len=65), ReferenceBackend(), BLOCK_SIZE)


def test_bfloat16_weights_and_float32_logits(saved_model):
    arch, path, _ = saved_model
    if arch != "llama":
        pytest.skip("one architecture is enough")
    loaded = load_model(ModelConfig(model=path, dtype="bfloat16"), ReferenceBackend(), BLOCK_SIZE)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert loaded.attention_spec.dtype == torch.bfloat16
    ours = run_two_steps(loaded, prompts(), 11, BLOCK_SIZE)
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in ours.values())


def test_unknown_rope_scaling_raises():
    config = LlamaConfig(**SMALL)
    theta, scaling = rope_parameters(config)
    assert scaling["rope_type"] == "default" and theta == config.rope_parameters["rope_theta"]
    with pytest.raises(NotImplementedError, match="made-up"):
        compute_inv_freq(16, 10000.0, {"rope_type": "made-up", "factor": 2.0})
