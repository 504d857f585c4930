"""Which shard counts a model's shapes allow, and how its attention heads split.

Query heads split evenly. KV heads split evenly when there are at least as many as shards;
with fewer, each shard holds the one KV head its query heads use (vLLM's rule: the shard
count must divide, or be a multiple of, the number of KV heads). `check_shardable` is the
one place this is checked, on the config, before anything is loaded. MLP widths and the
vocabulary need not divide: the last shard is padded (core/layers/parallel.py).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..layers.linear import Slice
from ..layers.parallel import TensorParallel
from ..params import ValidationError


def _heads(hf_config: Any) -> tuple[int, int]:
    hf_config = getattr(hf_config, "text_config", None) or hf_config  # a vision-language model's decoder
    heads = hf_config.num_attention_heads
    return heads, getattr(hf_config, "num_key_value_heads", None) or heads


def heads_split(num_heads: int, num_kv_heads: int, num_shards: int) -> bool:
    return num_heads % num_shards == 0 and (num_kv_heads % num_shards == 0 or num_shards % num_kv_heads == 0)


# core/loader/gguf_cache.py's "-<key>" suffix of a converted GGUF, and a GGUF's quantization suffix
_CACHE_KEY = re.compile(r"-[0-9a-f]{16}$")
_QUANTIZATION = re.compile(r"[.-](I?Q\d\w*|[bB]?[fF]16|[fF]32)$")


def _model_name(hf_config: Any) -> str:
    """The checkpoint's name as a user knows it (SmolLM2-135M-Instruct for the default model)."""
    path = str(getattr(hf_config, "_name_or_path", "") or "").rstrip("/")
    if path:
        return _QUANTIZATION.sub("", _CACHE_KEY.sub("", os.path.basename(path)))
    architectures = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "the model")]
    return str(architectures[0])


def _joined(numbers: list[int]) -> str:
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def check_shardable(hf_config: Any, num_shards: int) -> None:
    """Raises ValidationError (one line naming the numbers) when `num_shards` tensor-parallel
    shards cannot split this model's attention heads; 1 always works."""
    if num_shards < 1:
        raise ValidationError(f"--num-shard must be at least 1, got {num_shards}", "num_shard")
    heads, kv_heads = _heads(hf_config)
    if heads_split(heads, kv_heads, num_shards):
        return
    working = _joined([n for n in range(1, heads + 1) if heads_split(heads, kv_heads, n)])
    raise ValidationError(f"{_model_name(hf_config)} has {heads} attention heads and {kv_heads} KV heads: "
                          f"--num-shard {num_shards} does not divide them ({working} shards do)", "num_shard")


@dataclass(frozen=True)
class AttentionShard:
    """One shard's attention heads: how many query and KV heads it holds, and which rows of
    the checkpoint's q, k and v projections they are."""

    num_heads: int
    num_kv_heads: int
    q_rows: Slice
    kv_rows: Slice

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> AttentionShard:
        n, rank = tp.world_size, tp.rank
        if not heads_split(num_heads, num_kv_heads, n):
            raise ValidationError(f"{num_heads} attention heads and {num_kv_heads} KV heads do not split into {n} "
                                  "shards", "num_shard")
        heads = num_heads // n
        if num_kv_heads >= n:
            kv_heads, first_kv = num_kv_heads // n, rank * (num_kv_heads // n)
        else:  # replicated: shard `rank` uses KV head rank // (shards per KV head)
            kv_heads, first_kv = 1, rank // (n // num_kv_heads)
        return cls(heads, kv_heads, Slice(rank * heads * head_dim, heads * head_dim, num_heads * head_dim),
                   Slice(first_kv * head_dim, kv_heads * head_dim, num_kv_heads * head_dim))
