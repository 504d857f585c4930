"""Phi-3 / Phi-4 (core/models/phi3.py) against transformers on tiny random models:
fused qkv/gate_up checkpoints, partial rotary, longrope with its short and long factors
and attention factor, a sliding window, tied and untied heads."""
from __future__ import annotations

import math

import pytest
import torch
from model_helpers import Chunk, ReferenceBackend, run_step
from parity_helpers import one_thread, assert_greedy_matches, assert_logits_match, load_ours, save_tiny
from transformers import Phi3Config

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
             eos_token_id=2, bos_token_id=1, pad_token_id=0)
ORIGINAL_CONTEXT = 16


def longrope(rotary_dims: int) -> dict:
    half = rotary_dims // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary_dims / 16,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": ORIGINAL_CONTEXT}


def configs() -> dict:
    return {
        # Phi-3-mini shape: full rotary, default rope, separate lm_head
        "plain": Phi3Config(**SMALL, tie_word_embeddings=False),
        # Phi-4-mini shape: partial rotary (0.5), longrope, tied embeddings, a sliding window
        "longrope_partial": Phi3Config(**SMALL, tie_word_embeddings=True, sliding_window=6,
                                       original_max_position_embeddings=ORIGINAL_CONTEXT,
                                       rope_parameters=longrope(8)),
        # longrope on every dimension
        "longrope_full": Phi3Config(**SMALL, tie_word_embeddings=False,
                                    original_max_position_embeddings=ORIGINAL_CONTEXT,
                                    rope_parameters=longrope(16)),
    }


pytestmark = pytest.mark.usefixtures("one_thread")
assert one_thread  # the fixture, imported for pytest to find


@pytest.fixture(scope="module", params=sorted(configs()))
def phi3(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"phi3-{request.param}")
    hf = save_tiny(configs()[request.param], path)
    return request.param, path, hf


def test_logits_match_transformers_on_a_ragged_chunked_batch(phi3):
    """Served within the original context (max_model_len 16), longrope uses the short factors."""
    name, path, hf = phi3
    loaded = load_ours(path, max_model_len=ORIGINAL_CONTEXT)
    assert type(loaded.model).__name__ == "Phi3ForCausalLM"
    assert not loaded.model.model.rotary_emb.uses_long_factors
    assert_logits_match(loaded, hf, f"phi3 {name}")


def test_greedy_32_tokens_match_transformers(phi3):
    """Served past the original context, longrope uses the long factors for every token:
    transformers does so for a sequence longer than 16, so the prompts here are."""
    _, path, hf = phi3
    generator = torch.Generator().manual_seed(5)
    long_prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (17, 23)]
    loaded = load_ours(path)
    assert loaded.model.model.rotary_emb.uses_long_factors == (loaded.model.model.rotary_emb.long_inv_freq
                                                                is not None)
    assert_greedy_matches(loaded, hf, 32, long_prompts)


def test_fields(phi3):
    name, path, _ = phi3
    loaded = load_ours(path)
    assert [s.sliding_window for s in loaded.attention_specs] == ([6, 6] if name == "longrope_partial" else
                                                                   [None, None])
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == (name == "longrope_partial")
    rotary = loaded.model.model.rotary_emb
    assert rotary.inv_freq.shape == ((4,) if name == "longrope_partial" else (8,))
    assert (rotary.long_inv_freq is not None) == name.startswith("longrope")
    if name.startswith("longrope"):
        assert rotary.attention_scaling == pytest.approx((1 + math.log(4) / math.log(ORIGINAL_CONTEXT)) ** 0.5)


def test_long_factors_match_transformers_on_a_long_prompt(phi3):
    """A 20-token prompt (past the original 16) beside a second long one, chunked: with the
    long factors each equals transformers run on that request alone."""
    name, path, hf = phi3
    if name != "longrope_full":
        pytest.skip("one longrope model is enough")
    loaded = load_ours(path)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 128, (n,), generator=generator).tolist() for n in (20, 18))
    kv_caches = ReferenceBackend().allocate_kv_cache(loaded.num_layers, 12, loaded.attention_spec)
    step1 = run_step(loaded, kv_caches, [Chunk(first, 0, [1, 2, 3, 4, 5]), Chunk(second[:9], 0, [6, 7, 8, 9, 10])], 4)
    step2 = run_step(loaded, kv_caches, [Chunk(second[9:], 9, [6, 7, 8, 9, 10])], 4)
    for ids, got in zip((first, second), (step1[0], torch.cat([step1[1], step2[0]]))):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
