"""The rope variants of core/layers/rotary.py against transformers' own
ROPE_INIT_FUNCTIONS (inverse frequencies and attention factor), on configs that name them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from switchyard.core.layers.rotary import RotaryEmbedding, rope_frequencies, rope_parameters, rotary_dim

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_transformers(name):
    config = LlamaConfig(**SMALL, rope_parameters={"rope_theta": 5000.0, **VARIANTS[name]})
    theta, scaling = rope_parameters(config)
    ours = rope_frequencies(16, theta, scaling)
    rope_type = config.rope_parameters["rope_type"]
    expected, attention = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu") if rope_type != "default" else (None, 1)
    torch.testing.assert_close(ours.inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(attention)


def test_longrope_short_and_long_factors_match_transformers():
    factors = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [4.0, 5.0, 6.0, 8.0]}
    config = Phi3Config(**SMALL, original_max_position_embeddings=64,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                                         **factors})
    theta, scaling = rope_parameters(config)
    dim = rotary_dim(config, 16)
    assert dim == 8
    ours = rope_frequencies(dim, theta, scaling)
    short, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=65)
    torch.testing.assert_close(ours.inv_freq, short)
    torch.testing.assert_close(ours.long_inv_freq, long)
    assert ours.attention_scaling == pytest.approx(attention) and attention > 1
    rotary = RotaryEmbedding(dim, theta, scaling)
    assert rotary.uses_long_factors  # unless told the served context fits the original one
    rotary.fit_context(64)
    cos, _ = rotary(torch.tensor([3]), torch.float32)
    assert not rotary.uses_long_factors
    torch.testing.assert_close(cos[0, 0, :4], torch.cos(3 * short) * attention)


def test_su_is_longrope():
    """transformers 4.x-style config.json fields (rope_theta + rope_scaling of type "su")."""
    config = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=128, original_max_position_embeddings=32,
                             rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]})
    theta, scaling = rope_parameters(config)
    assert theta == 10000.0 and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 32
