"""Named model shapes for dummy weights: registry values, loading a scaled-down one, the tokenizer."""
from __future__ import annotations

import pytest
import torch

from switchyard.core.config import ModelConfig
from switchyard.core.layers import rope_parameters
from switchyard.core.loader import NAMED_CONFIGS, ModelNotFoundError, load_tokenizer, named_config, resolve_source


def test_llama_3_8b_has_the_published_shape():
    config = named_config("Llama-3-8B")
    assert type(config).__name__ == "LlamaConfig"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (128256, 4096, 14336)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 32, 8)
    assert (config.max_position_embeddings, config.rms_norm_eps, config.tie_word_embeddings) == (8192, 1e-5, False)
    assert (config.bos_token_id, config.eos_token_id) == (128000, 128001)
    assert rope_parameters(config) == (500000.0, {"rope_theta": 500000.0, "rope_type": "default"})
    params = 128256 * 4096 * 2 + 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert params == 8_030_261_248  # the published 8.03B parameters


def test_llama_3_1_uses_llama3_rope_scaling():
    _, scaling = rope_parameters(named_config("llama-3.1-8b"))
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert named_config("llama-3.2-1b").tie_word_embeddings and named_config("llama-3.2-1b").head_dim == 64


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="llama-3-8b"):
        named_config("gpt-5")
    assert {"llama-3-8b", "llama-3.1-8b", "llama-3.2-1b", "llama-tiny"} <= set(NAMED_CONFIGS)


def test_a_named_shape_resolves_only_with_dummy_weights():
    assert resolve_source(ModelConfig(model="llama-3-8b", load_format="dummy")).kind == "named"
    with pytest.raises(ModelNotFoundError, match="load_format='dummy'"):
        resolve_source(ModelConfig(model="llama-3-8b"))


def test_a_scaled_down_llama_3_8b_runs_offline_through_the_llm_api(monkeypatch):
    from switchyard.core.loader import named_configs
    from switchyard.core.llm import LLM
    from switchyard.core.params import SamplingParams

    small = dict(NAMED_CONFIGS["llama-3-8b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, bos_token_id=1000,
                 eos_token_id=1001)
    monkeypatch.setitem(named_configs.NAMED_CONFIGS, "llama-3-8b", small)
    llm = LLM(model="llama-3-8b", load_format="dummy", backend="cpu", num_kv_blocks=32)
    assert llm.engine.info.eos_token_ids == (1001,)
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.prompt_token_ids == tuple(llm.tokenizer.encode("hello"))


def test_dummy_tokenizer_round_trips_text_and_names_other_ids():
    tokenizer = load_tokenizer(ModelConfig(model="llama-3-8b", load_format="dummy"))
    assert len(tokenizer) == 128256 and tokenizer.eos_token_id == 128001 and tokenizer.bos_token_id == 128000
    ids = tokenizer.encode("Hi wörld")
    assert max(ids) < 256 and tokenizer.decode(ids) == "Hi wörld"
    assert tokenizer.decode([300, 128001]) == "<300><128001>"


def test_dummy_weights_are_drawn_on_the_parameter_device_deterministically():
    from switchyard.core.loader.dummy import fill_dummy_weights

    def filled(seed):
        layer = torch.nn.Linear(8, 8)
        fill_dummy_weights(layer, seed)
        return layer.weight.detach().clone()

    assert torch.equal(filled(1), filled(1)) and not torch.equal(filled(1), filled(2))
    assert 0.005 < filled(1).std() < 0.05
