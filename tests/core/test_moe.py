"""Mixtral, Qwen2-MoE and Qwen3-MoE (core/models/moe.py) against transformers on tiny
random models, and the batched expert path (core/layers/fused_moe.py) against a
per-token loop."""
from __future__ import annotations

import pytest
import torch
from parity_helpers import one_thread, assert_greedy_matches, assert_logits_match, load_ours, save_tiny
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from switchyard.core.layers.fused_moe import fused_experts, select_experts

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
             eos_token_id=2, bos_token_id=1, pad_token_id=0)


def configs() -> dict:
    return {
        # 4 experts, top-2, separate lm_head, a sliding window
        "mixtral": MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                 tie_word_embeddings=False),
        # shared expert with its sigmoid gate, q/k/v bias, no top-k renormalisation, layer 1 dense
        "qwen2_moe": Qwen2MoeConfig(**SMALL, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    mlp_only_layers=[1], tie_word_embeddings=True),
        # q/k norms, head_dim 24, renormalised top-3 of 6
        "qwen3_moe": Qwen3MoeConfig(**SMALL, head_dim=24, num_experts=6, num_experts_per_tok=3,
                                    moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
    }


pytestmark = pytest.mark.usefixtures("one_thread")
assert one_thread  # the fixture, imported for pytest to find


@pytest.fixture(scope="module", params=sorted(configs()))
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(configs()[request.param], path)
    return request.param, path, hf


def test_logits_match_transformers_on_a_ragged_chunked_batch(moe):
    name, path, hf = moe
    loaded = load_ours(path)
    assert type(loaded.model).__name__ == "MoeForCausalLM"
    assert_logits_match(loaded, hf, name)


def test_greedy_32_tokens_match_transformers(moe):
    _, path, hf = moe
    assert_greedy_matches(load_ours(path), hf, 32)


def test_layers_and_stacked_checkpoint_names(moe):
    """Which layers are sparse; and transformers 5's in-memory names (experts stacked as
    gate_up_proj [E, 2I, H] / down_proj [E, H, I]) load to the same model."""
    name, path, hf = moe
    loaded = load_ours(path)
    kinds = [type(layer.mlp).__name__ for layer in loaded.model.model.layers]
    assert kinds == (["SparseMoeBlock", "LlamaMLP"] if name == "qwen2_moe" else ["SparseMoeBlock"] * 2)
    assert (loaded.model.model.layers[0].mlp.shared_expert is not None) == (name == "qwen2_moe")
    state = hf.state_dict()
    assert any(key.endswith("experts.gate_up_proj") for key in state)
    again = load_ours(path, load_format="dummy")
    with torch.no_grad():
        loaded_names = again.model.load_weights(state.items())
    assert loaded_names == set(dict(again.model.named_parameters()))
    for (key, ours), theirs in zip(loaded.model.state_dict().items(), again.model.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=key)


def test_experts_stacked_per_projection_as_in_gguf(moe):
    """[E, I, H] gate and up and [E, H, I] down tensors (GGUF's ffn_*_exps) load too."""
    name, path, hf = moe
    loaded = load_ours(path)
    again = load_ours(path, load_format="dummy")
    state = hf.state_dict()
    weights = []
    for key, tensor in state.items():
        if key.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            weights += [(key.replace("gate_up_proj", "gate_proj"), gate), (key.replace("gate_up_proj", "up_proj"), up)]
        else:
            weights.append((key, tensor))
    with torch.no_grad():
        assert again.model.load_weights(weights) == set(dict(again.model.named_parameters()))
    for (key, ours), theirs in zip(loaded.model.state_dict().items(), again.model.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=key)


def test_unknown_expert_weight_is_refused(moe):
    name, path, _ = moe
    loaded = load_ours(path, load_format="dummy")
    with pytest.raises(ValueError, match="no matching expert"):
        loaded.model.load_weights([("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(1))])


def _per_token_loop(hidden, w13, w2, weights, ids):
    """The obvious (slow) definition: every token, each of its k experts in turn."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for weight, expert in zip(weights[t], ids[t]):
            gate, up = (w13[expert] @ hidden[t]).chunk(2)
            out[t] += weight * (w2[expert] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_experts_equal_a_per_token_loop(num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 32, generator=generator)
    w13, w2 = torch.randn(8, 2 * 24, 32, generator=generator), torch.randn(8, 32, 24, generator=generator)
    weights, ids = select_experts(torch.randn(num_tokens, 8, generator=generator), 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    expected = _per_token_loop(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(hidden, w13, w2, weights, ids), expected,
                               atol=1e-4, rtol=1e-4)


def test_fused_experts_in_bfloat16_stay_close():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=generator)
    w13, w2 = torch.randn(4, 48, 32, generator=generator) * 0.1, torch.randn(4, 32, 24, generator=generator) * 0.1
    weights, ids = select_experts(torch.randn(6, 4, generator=generator), 2, renormalize=False)
    expected = fused_experts(hidden, w13, w2, weights, ids)
    got = fused_experts(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
