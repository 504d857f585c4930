"""The pure-torch Gemma 2 and Gemma 3 text models against transformers, on tiny random
models: logits of a ragged chunked batch (reference kernel) and 32 greedy tokens through
the real engine on the CPU backend (its soft-cap and sliding-window attention)."""
from __future__ import annotations

import pytest
import torch
from model_helpers import ReferenceBackend, assert_two_steps_match, hf_greedy, make_hf, ragged_prompts
from transformers import Gemma2Config, Gemma3TextConfig

from switchyard.core import LLM, SamplingParams
from switchyard.core.config import ModelConfig
from switchyard.core.layers.gelu import GeluAndMul
from switchyard.core.loader import load_model
from switchyard.core.models import GemmaForCausalLM, model_class

BLOCK_SIZE = 4
VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
             eos_token_id=1, bos_token_id=2, pad_token_id=0)
# Windows shorter than the prompts, caps low enough to bite, a query_pre_attn_scalar that is
# not head_dim, and for Gemma 3 a local rope base and a scaled global rope that differ.
GEMMA2 = dict(**SMALL, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
              final_logit_softcapping=4.0, tie_word_embeddings=False)
GEMMA3 = dict(**SMALL, num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=20, final_logit_softcapping=None,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
              tie_word_embeddings=True)


def tiny_configs() -> dict:
    return {"gemma2": Gemma2Config(**GEMMA2), "gemma3": Gemma3TextConfig(**GEMMA3)}


@pytest.fixture(scope="module", params=sorted(tiny_configs()))
def saved_model(request, tmp_path_factory, default_tokenizer):
    hf = make_hf(tiny_configs()[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    default_tokenizer.save_pretrained(path)  # decodes ids < VOCAB; the offline API needs a tokenizer
    return request.param, str(path), hf


def test_registered_for_both_model_types():
    for config in tiny_configs().values():
        assert model_class(config) is GemmaForCausalLM


def test_matches_transformers_on_a_ragged_chunked_batch(saved_model):
    _, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path), ReferenceBackend(), BLOCK_SIZE)
    # B (12 tokens) is longer than both windows; its second chunk sees a cached prefix
    prompts = ragged_prompts(VOCAB, {"A": 7, "B": 12, "C": 3})
    assert_two_steps_match(loaded, hf, prompts, decode_token=11, block_size=BLOCK_SIZE)


def test_attention_specs_follow_the_layer_types(saved_model):
    arch, path, _ = saved_model
    loaded = load_model(ModelConfig(model=path), ReferenceBackend(), BLOCK_SIZE)
    specs = loaded.attention_specs
    if arch == "gemma2":  # layer_types default: sliding, full, sliding
        assert [s.sliding_window for s in specs] == [5, None, 5]
        assert {s.soft_cap for s in specs} == {3.0} and {s.scale for s in specs} == {24 ** -0.5}
    else:  # Gemma 3's attention is not soft-capped, whatever the config says
        assert [s.sliding_window for s in specs] == [6, 6, None, 6]
        assert {s.soft_cap for s in specs} == {None} and {s.scale for s in specs} == {20 ** -0.5}
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == (arch == "gemma3")


@pytest.fixture(scope="module")
def llm(saved_model):
    """The real engine on the CPU backend; a 6-token step budget chunks every long prompt."""
    arch, path, hf = saved_model
    return arch, hf, LLM(model=path, backend="cpu", block_size=BLOCK_SIZE, num_kv_blocks=128,
                         max_num_batched_tokens=6, max_num_seqs=8)


def test_greedy_32_tokens_equal_transformers(llm):
    arch, hf, engine = llm
    prompts = list(ragged_prompts(VOCAB, {"A": 9, "B": 3, "C": 14}, seed=3).values())
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(hf, prompt, 32), (arch, prompt)


def test_bfloat16_runs_with_float32_logits(saved_model):
    """bf16 weights and activations: within bf16 noise of the float32 reference (logits reach ~9)."""
    _, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path, dtype="bfloat16"), ReferenceBackend(), BLOCK_SIZE)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.model.embed_tokens.scale.dtype == torch.bfloat16
    prompts = ragged_prompts(VOCAB, {"A": 7, "B": 12, "C": 3})
    assert_two_steps_match(loaded, hf, prompts, decode_token=11, block_size=BLOCK_SIZE, atol=0.5, rtol=0.05)


@pytest.mark.parametrize("arch,change", [
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(sliding_window=64)),
    ("gemma2", dict(query_pre_attn_scalar=16)),
    ("gemma3", dict(sliding_window=64)),
    ("gemma3", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}})),
    ("gemma3", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
])
def test_each_feature_changes_the_logits(arch, change):
    """Guards the tests above: each Gemma feature the tiny configs turn on changes
    transformers' logits by far more than the tolerance, so leaving it out would fail them."""
    base = dict(GEMMA2 if arch == "gemma2" else GEMMA3)
    config_class = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    ids = torch.tensor([ragged_prompts(VOCAB, {"B": 12})["B"]])
    with torch.no_grad():
        logits = [make_hf(config_class(**{**base, **overrides})).eval()(ids).logits for overrides in ({}, change)]
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_gelu_and_mul_is_gemma_geglu():
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    gate, up = x[:, :4], x[:, 4:]
    torch.testing.assert_close(GeluAndMul()(x), torch.nn.functional.gelu(gate, approximate="tanh") * up,
                               atol=0, rtol=0)
    assert not torch.equal(GeluAndMul("gelu")(x), GeluAndMul()(x))
    with pytest.raises(NotImplementedError, match="relu"):
        GeluAndMul("relu")


def test_bidirectional_gemma_is_refused():
    config = Gemma3TextConfig(**{**GEMMA3, "use_bidirectional_attention": True})
    with pytest.raises(NotImplementedError, match="bidirectional"):
        GemmaForCausalLM(config, lambda spec: None, BLOCK_SIZE, torch.float32)
