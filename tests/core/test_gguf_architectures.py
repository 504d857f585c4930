"""GGUF loading beyond the default model: for each architecture, a tiny random model
written as a GGUF file loads here with tensors bit-identical to transformers' own GGUF
load, and, where a native model exists, with the same logits on a ragged chunked batch;
so does a cached start, from the config kept as plain attributes and the tensor index (no
transformers config class, transformers' processors replaced by ours)."""
from __future__ import annotations

import pytest
import torch
from gguf_files import GGUF_ARCHITECTURES, write_gguf
from model_helpers import ReferenceBackend, assert_two_steps_match, ragged_prompts, randomize
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

import switchyard.core.loader as loader
from switchyard.core.config import ModelConfig
from switchyard.core.loader import ModelSource, load_model
from switchyard.core.loader.gguf_weights import GGUFWeights, load_gguf_config
from switchyard.core.models import MODEL_TYPES
from switchyard.core.models.plain_config import PlainConfig, write_plain_config

BLOCK_SIZE = 4
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
CONFIGS = {  # what a GGUF's metadata can express (transformers' defaults fill in the rest)
    "llama": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    # transformers reads no head_dim from a qwen3 GGUF: Qwen3's default, 128, it is
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=128, tie_word_embeddings=False),
    "gemma2": lambda: Gemma2Config(**SMALL, head_dim=16, sliding_window=5),
    "gemma3_text": lambda: Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=5),
    # nor a pad id from a phi3 one: Phi-3's default, 32000, must be a token
    "phi3": lambda: Phi3Config(**{**SMALL, "vocab_size": 32064}, tie_word_embeddings=False),
}
assert set(CONFIGS) == set(GGUF_ARCHITECTURES)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gguf_file(request, tmp_path_factory):
    """(model type, GGUF path, transformers' own load of that GGUF)."""
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), attn_implementation="eager",
                                          dtype=torch.float32)
    randomize(hf)
    directory = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = directory / f"tiny-{request.param}.gguf"
    write_gguf(hf, str(path))
    reference = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager")
    return request.param, str(path), reference.eval()


def test_tensors_equal_transformers_gguf_load(gguf_file):
    model_type, path, reference = gguf_file
    config = load_gguf_config(path)
    assert config.model_type == model_type
    ours = dict(GGUFWeights(path, config))
    expected = reference.state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name


def test_logits_equal_transformers_gguf_load(gguf_file):
    model_type, path, reference = gguf_file
    if model_type not in MODEL_TYPES:
        pytest.skip(f"no native {model_type} model on this branch")
    loaded = load_model(ModelConfig(model=path, cache_dir=""), ReferenceBackend(), BLOCK_SIZE)
    assert_two_steps_match(loaded, reference, ragged_prompts(VOCAB, {"A": 7, "B": 12, "C": 3}), decode_token=11,
                           block_size=BLOCK_SIZE)


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_a_cached_start_from_plain_attributes_gives_the_same_logits(gguf_file, model_impl, tmp_path, monkeypatch):
    """The converted metadata's plain config (and, on the second load, the tensor index with
    its processor kind) against transformers' own GGUF load; the fallback takes the plain
    config back to transformers' class."""
    model_type, path, reference = gguf_file
    if model_type not in MODEL_TYPES:
        pytest.skip(f"no native {model_type} model on this branch")
    write_plain_config(load_gguf_config(path), str(tmp_path))  # as a conversion keeps it
    converted = ModelSource("gguf", path, "gguf", gguf_file=path, metadata=str(tmp_path))
    monkeypatch.setattr(loader, "resolve_source", lambda model_config: converted)
    for _ in range(2):  # the first load indexes the file, the second reads the index
        loaded = load_model(ModelConfig(model=path, model_impl=model_impl), ReferenceBackend(), BLOCK_SIZE)
        assert type(loaded.hf_config) is PlainConfig and loaded.model_impl == ("native" if model_impl == "auto"
                                                                                else "transformers")
    assert_two_steps_match(loaded, reference, ragged_prompts(VOCAB, {"A": 7, "B": 12, "C": 3}), decode_token=11,
                           block_size=BLOCK_SIZE)


@pytest.mark.parametrize("model_type, layers, hidden, heads, head_dim, scalar", [
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B
    ("gemma3_text", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ("gemma3_text", 34, 2560, 8, 256, 256),  # Gemma 3 4B: transformers' default, head_dim
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma 2 9B
])
def test_a_gemma_gguf_scales_queries_as_llama_cpp(model_type, layers, hidden, heads, head_dim, scalar):
    """A GGUF holds no query_pre_attn_scalar: llama.cpp gives the 27Bs hidden / heads (144, 168), the
    others head_dim; transformers' reader leaves its default, 256, for all (llama_cpp_derived)."""
    from transformers import AutoConfig

    from switchyard.core.loader.gguf_weights import llama_cpp_derived

    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                  head_dim=head_dim)
    assert config.query_pre_attn_scalar == 256
    assert llama_cpp_derived(config).query_pre_attn_scalar == scalar
