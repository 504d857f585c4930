"""Tensor-parallel native models (core/layers/parallel.py) against the same models unsharded:
tiny random checkpoints loaded by `load_model` with a sharded ShardInfo in 2 or 3 processes
over gloo on loopback; every rank's logits of a ragged chunked batch (plus a decode) must
match the unsharded model's, each rank must hold and read only its slices, and shard
counts the heads do not allow are refused in one line before anything is loaded."""
from __future__ import annotations

import pytest
import torch
from model_helpers import ReferenceBackend, ragged_prompts, run_two_steps, save_tiny
from parity_helpers import greedy_ours
from tp_helpers import run_sharded
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig

from switchyard.backends.cpu.linear import pack_linears, packing_supported
from switchyard.core.backend import ShardInfo
from switchyard.core.config import ModelConfig
from switchyard.core.loader import load_model, safetensors_weights
from switchyard.core.models import check_shardable
from switchyard.core.params import ValidationError

BLOCK_SIZE = 4
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, pad_token_id=0)
GEMMA = dict(SMALL, head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=20)
# the large matrices, whose bytes each shard should hold about 1/N of
BIG = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "embed_tokens.weight",
       "lm_head.weight", "w13_weight", "w2_weight")


def two_shard_configs() -> dict:
    return {
        # 4 heads / 2 KV heads; q/k/v, o and MLP biases (o and down: added once); untied head;
        # a vocabulary of 127 (the last shard's slice is padded)
        "llama": LlamaConfig(**SMALL, vocab_size=127, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        # 4 heads / 1 KV head: the KV head is replicated on both shards; tied embeddings, q/k/v bias
        "replicated_kv": Qwen2Config(**{**SMALL, "num_key_value_heads": 1}, vocab_size=128, tie_word_embeddings=True),
        # scaled embedding, post-norms after the reduce, attention and final soft caps
        "gemma2": Gemma2Config(**GEMMA, vocab_size=128, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                               sliding_window=5, tie_word_embeddings=False),
        "gemma3": Gemma3TextConfig(**GEMMA, vocab_size=128, sliding_window=6, tie_word_embeddings=True),
        # q/k/v and gate/up fused in the checkpoint: each shard reads its rows of each part
        "phi3": Phi3Config(**SMALL, vocab_size=128, hidden_act="silu", tie_word_embeddings=False),
        # experts sliced along their intermediate dimension; shared expert and its gate; layer 1 dense
        "qwen2_moe": Qwen2MoeConfig(**SMALL, vocab_size=128, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True),
    }


def three_shard_config() -> LlamaConfig:
    """The default model's heads (9 / 3 KV, tied), tiny; MLP width 100 and vocabulary 130
    do not divide by 3 (padded)."""
    return LlamaConfig(**{**SMALL, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 72,
                          "intermediate_size": 100}, vocab_size=130, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    configs = {**two_shard_configs(), "nine_heads": three_shard_config()}
    paths = {}
    for name, config in configs.items():
        path = tmp_path_factory.mktemp(name)
        save_tiny(config, path)
        paths[name] = str(path)
    return paths


def logits_of(loaded) -> dict[str, torch.Tensor]:
    return run_two_steps(loaded, ragged_prompts(loaded.vocab_size), decode_token=11, block_size=BLOCK_SIZE)


def shard_job(shard: ShardInfo, communicator, models: dict[str, dict], greedy: tuple[str, ...]) -> dict:
    """In each shard process: every model's (name: ModelConfig fields, and "pack": swap its
    Linears for the CPU backend's packed ones) logits, its big parameters, what it read."""
    read: list[int] = []
    narrow = safetensors_weights.LazyTensor.narrow

    def counting_narrow(self, dim, start, length):
        out = narrow(self, dim, start, length)
        read.append(out.numel())
        return out

    safetensors_weights.LazyTensor.narrow = counting_narrow
    results = {}
    for name, fields in models.items():
        read.clear()
        fields = dict(fields)
        pack = fields.pop("pack", False)
        loaded = load_model(ModelConfig(**fields), ReferenceBackend(), BLOCK_SIZE, shard, communicator)
        if pack:
            assert pack_linears(loaded.model) > 0
        spec = loaded.attention_spec
        results[name] = {
            "logits": logits_of(loaded), "elements_read": sum(read),
            "heads": (spec.num_heads, spec.num_kv_heads),
            "shapes": {k: tuple(v.shape) for k, v in loaded.model.state_dict().items()},
            "big_bytes": sum(p.numel() * p.element_size() for k, p in loaded.model.named_parameters()
                             if k.endswith(BIG)),
            "greedy": greedy_ours(loaded, list(ragged_prompts(loaded.vocab_size).values()), 32)
            if name in greedy else None,
        }
    return results


def unsharded(path: str) -> dict:
    loaded = load_model(ModelConfig(model=path), ReferenceBackend(), BLOCK_SIZE)
    return {"loaded": loaded, "logits": logits_of(loaded),
            "big_bytes": sum(p.numel() * p.element_size() for k, p in loaded.model.named_parameters()
                             if k.endswith(BIG)),
            "elements": sum(p.numel() for p in loaded.model.parameters())}


def assert_matches_unsharded(per_rank: list[dict], name: str, path: str) -> dict:
    whole = unsharded(path)
    for rank, results in enumerate(per_rank):
        ours = results[name]["logits"]
        for key, expected in whole["logits"].items():
            assert ours[key].shape == expected.shape
            torch.testing.assert_close(ours[key], expected, atol=1e-4, rtol=1e-4, msg=f"{name} rank {rank} {key}")
    return whole


@pytest.fixture(scope="module")
def two_shards(checkpoints) -> list[dict]:
    models = {name: {"model": checkpoints[name]} for name in two_shard_configs()}
    models["dummy"] = {"model": "llama-tiny", "load_format": "dummy"}
    if packing_supported():
        models["llama_packed"] = {"model": checkpoints["llama"], "pack": True}
    return run_sharded(2, shard_job, models, ("llama",))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(two_shard_configs()))
def test_two_shards_match_the_unsharded_model(two_shards, checkpoints, name):
    whole = assert_matches_unsharded(two_shards, name, checkpoints[name])
    world = 2
    # each shard holds about half the big matrices: a padding row of the vocabulary more, or
    # (replicated_kv) the KV head both shards need: 4 of q/k/v's 6 heads instead of 3
    margin = 1.07 if name == "replicated_kv" else 1.02
    for results in two_shards:
        assert results[name]["big_bytes"] <= whole["big_bytes"] / world * margin
        # and read only its slices: its parameters, not a full copy of the checkpoint
        assert 0 < results[name]["elements_read"] <= whole["elements"] / world * (margin + 0.05)


@pytest.mark.slow
def test_two_shards_split_heads_and_replicate_a_lone_kv_head(two_shards):
    rank0, rank1 = (results["llama"]["shapes"] for results in two_shards)
    assert [r["llama"]["heads"] for r in two_shards] == [(2, 1), (2, 1)]
    assert rank0["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * 16, 64)
    assert rank0["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert rank0["model.layers.0.mlp.gate_up_proj.weight"] == (96, 64)
    assert rank0["model.layers.0.mlp.down_proj.weight"] == (64, 48)
    assert rank0["model.embed_tokens.weight"] == rank1["model.embed_tokens.weight"] == (64, 64)  # 127 padded
    assert rank0["lm_head.weight"] == (64, 64)
    # the row-parallel bias lives on rank 0 only: it is added once
    assert "model.layers.0.self_attn.o_proj.bias" in rank0 and "model.layers.0.self_attn.o_proj.bias" not in rank1
    assert "model.layers.0.mlp.down_proj.bias" in rank0 and "model.layers.0.mlp.down_proj.bias" not in rank1
    # one KV head, four query heads: each shard holds two query heads and the KV head
    assert [r["replicated_kv"]["heads"] for r in two_shards] == [(2, 1), (2, 1)]
    assert two_shards[0]["replicated_kv"]["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == (64, 64)


@pytest.mark.slow
@pytest.mark.skipif(not packing_supported(), reason="oneDNN weight packing is not available")
def test_backend_swapped_linears_keep_the_sum_right(two_shards, checkpoints):
    """The all-reduce sits outside the Linear and the row-parallel bias on rank 0 only, so a
    backend that swaps every Linear for its own (the CPU backend's packed ones) still sums right."""
    assert_matches_unsharded(two_shards, "llama_packed", checkpoints["llama"])


@pytest.mark.slow
def test_a_named_shape_with_dummy_weights_runs_sharded(two_shards):
    """`--model llama-tiny --load-format dummy` sharded: every rank ends with the same finite logits."""
    rank0, rank1 = (results["dummy"]["logits"] for results in two_shards)
    for key, logits in rank0.items():
        assert torch.isfinite(logits).all() and torch.equal(logits, rank1[key])


@pytest.mark.slow
def test_two_shards_greedy_32_tokens_equal_one_shard(two_shards, checkpoints):
    loaded = load_model(ModelConfig(model=checkpoints["llama"]), ReferenceBackend(), BLOCK_SIZE)
    expected = greedy_ours(loaded, list(ragged_prompts(loaded.vocab_size).values()), 32)
    assert [r["llama"]["greedy"] for r in two_shards] == [expected, expected]


@pytest.mark.slow
def test_three_shards_with_the_default_models_heads(checkpoints):
    per_rank = run_sharded(3, shard_job, {"nine_heads": {"model": checkpoints["nine_heads"]}}, ())
    whole = assert_matches_unsharded(per_rank, "nine_heads", checkpoints["nine_heads"])
    assert [r["nine_heads"]["heads"] for r in per_rank] == [(3, 1)] * 3
    for results in per_rank:
        assert results["nine_heads"]["shapes"]["model.layers.0.mlp.down_proj.weight"] == (72, 34)  # 100 padded
        assert results["nine_heads"]["big_bytes"] <= whole["big_bytes"] / 3 * 1.05


def test_heads_that_do_not_split_are_refused_in_one_line(checkpoints):
    config = three_shard_config()
    config._name_or_path = "/cache/gguf/SmolLM2-135M-Instruct.Q4_1-9be20bc2f9df0746"
    with pytest.raises(ValidationError) as error:
        check_shardable(config, 2)
    assert str(error.value) == ("SmolLM2-135M-Instruct has 9 attention heads and 3 KV heads: --num-shard 2 "
                                "does not divide them (1, 3 and 9 shards do)")
    for shards in (1, 3, 9):
        check_shardable(config, shards)
    check_shardable(LlamaConfig(**{**SMALL, "num_key_value_heads": 1}), 4)  # KV head replicated 4 times
    with pytest.raises(ValidationError, match="4 attention heads and 2 KV heads: --num-shard 3"):
        check_shardable(LlamaConfig(**SMALL), 3)
    # load_model checks before it builds or reads anything (no communicator is even needed)
    with pytest.raises(ValidationError, match="9 attention heads and 3 KV heads: --num-shard 2"):
        load_model(ModelConfig(model=checkpoints["nine_heads"]), ReferenceBackend(), BLOCK_SIZE,
                   ShardInfo(rank=0, world_size=2))


def test_lazy_safetensors_read_only_the_slice(checkpoints):
    files = safetensors_weights.safetensors_files(checkpoints["llama"])
    eager = dict(safetensors_weights.iterate_safetensors(files))
    for name, lazy in safetensors_weights.iterate_safetensors(files, lazy=True):
        assert lazy.shape == eager[name].shape
        dim = len(lazy.shape) - 1  # the last dim: rows of a matrix, or a 1-d tensor
        part = lazy.narrow(dim, 1, 2)
        assert torch.equal(part, eager[name].narrow(dim, 1, 2))
