"""The CUDA backend's host-side logic on a CPU, device calls faked: probing, the
flash-attn choice, warm-up memory profiling and KV sizing, NCCL init and the launcher."""
from __future__ import annotations

import dataclasses

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from cuda_fakes import MiB, CpuCudaBackend, DeviceReferenceKernel, FakeDevice, make_engine
from switchyard.backends.cuda import CudaBackend, GpuShardLauncher, probe_cuda, visible_device_ids
from switchyard.backends.cuda import backend as cuda_backend_module
from switchyard.backends.cuda.flash import FlashAttnKernel, choose_attention
from switchyard.backends.cuda.memory import (KV_HEADROOM, MemoryProfile, kv_cache_budget_bytes,
                                             num_kv_blocks_from_profile, profile_requests)
from switchyard.core.backend import AttentionMetadata, AttentionSpec, ShardInfo
from switchyard.core.config import CacheConfig
from switchyard.core.ops.attention import ReferenceAttentionKernel, paged_attention_reference

GiB = 2**30


@pytest.fixture
def cuda_torch(monkeypatch):
    """Makes this CPU torch look like a CUDA build with one visible device."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",  # triton installed or not, the probe sees it
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))


def test_probe_here_says_there_is_no_cuda_build():
    result = CudaBackend.probe()
    assert not result.usable and "built without CUDA" in result.reason


def test_probe_reasons(cuda_torch, monkeypatch):
    assert probe_cuda().usable and probe_cuda().reason.startswith("1 CUDA device visible")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "triton is not installed" in probe_cuda().reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe_cuda().reason == "no CUDA device visible (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES='')"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm (HIP) build: the rocm backend serves it" in probe_cuda().reason


def test_probe_never_raises(cuda_torch, monkeypatch):
    def boom():
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    result = probe_cuda()
    assert not result.usable and result.reason == "probing CUDA failed: RuntimeError: driver too old"


def test_capabilities_without_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    caps = CudaBackend().capabilities()
    assert caps.graph_mode and caps.mixed_prefill_decode and "bfloat16" in caps.dtypes and 16 in caps.block_sizes
    assert caps.attention_impl == "triton paged attention (flash-attn not installed)"


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """An installed flash_attn whose varlen kernel is the reference, checking its arguments."""
    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size, softcap, block_table):
        calls.append(dict(cu_seqlens_k=cu_seqlens_k.tolist(), window_size=window_size, causal=causal))
        seq_lens = torch.diff(cu_seqlens_k).tolist()
        kv = torch.stack([k, v])
        return paged_attention_reference(q, kv, cu_seqlens_q.tolist(), seq_lens, block_table, softmax_scale,
                                         None if window_size[0] < 0 else window_size[0] + 1, softcap or None)

    module = types.SimpleNamespace(__version__="2.7.4", flash_attn_varlen_func=varlen, calls=calls)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


def spec_of(block_size=16, dtype=torch.bfloat16, window=None):
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=block_size, scale=0.35, dtype=dtype,
                         sliding_window=window)


def test_flash_attn_is_chosen_when_installed_and_fit(fake_flash_attn):
    assert CudaBackend().capabilities().attention_impl.startswith("flash-attn varlen (flash_attn 2.7.4 installed")
    backend = CudaBackend()
    kernel = backend.attention(spec_of(block_size=256))
    assert isinstance(kernel, FlashAttnKernel) and kernel.graph_safe
    assert backend.attention_choices[spec_of(block_size=256)].reason == "flash-attn varlen (flash_attn 2.7.4 installed)"
    small = choose_attention(spec_of(block_size=16), fake_flash_attn)
    assert small.impl == "triton" and "block_size % 256 == 0, got 16" in small.reason
    fp32 = choose_attention(spec_of(block_size=256, dtype=torch.float32), fake_flash_attn)
    assert fp32.impl == "triton" and "fp16/bf16" in fp32.reason
    assert choose_attention(spec_of(), None).reason == "triton paged attention (flash-attn not installed)"
    quantized = choose_attention(dataclasses.replace(spec_of(block_size=256), kv_cache_dtype="int8"), fake_flash_attn)
    assert quantized.impl == "triton" and "it reads no int8 KV cache (--kv-cache-dtype)" in quantized.reason


def test_the_cuda_backend_declares_the_quantized_kv_caches_its_triton_kernels_read():
    assert CudaBackend().capabilities().kv_cache_dtypes == ("int8", "fp8_e4m3fn", "fp8_e5m2")


def test_flash_kernel_passes_key_lengths_window_and_block_table(fake_flash_attn):
    spec = spec_of(block_size=4, dtype=torch.float32, window=3)
    written = []
    kernel = FlashAttnKernel(spec, fake_flash_attn.flash_attn_varlen_func, lambda *a: written.append(a))
    torch.manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8)
    table = torch.tensor([[2, 5], [1, 0]], dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 3], dtype=torch.int32), block_table=table,
                             slot_mapping=torch.tensor([21, 4, 5, 6]), num_decodes=1, max_query_len=3, max_seq_len=6,
                             query_start_loc_cpu=(0, 1, 4), seq_lens_cpu=(6, 3))
    query = torch.randn(4, 4, 8)
    kernel.write_kv(query[:, :2], query[:, 2:], cache, meta)
    assert written[0][3] is meta.slot_mapping
    out = kernel.forward(query, cache, meta)
    assert fake_flash_attn.calls[-1] == dict(cu_seqlens_k=[0, 6, 9], window_size=(2, 0), causal=True)
    expected = paged_attention_reference(query, cache, [0, 1, 4], [6, 3], table, 0.35, 3)
    torch.testing.assert_close(out, expected)


def test_flash_sliding_layers_hand_steps_with_window_anchors_to_the_triton_kernel(fake_flash_attn, monkeypatch):
    """flash-attn takes one window per call: a step with window anchors (image rows,
    AttentionMetadata.window_anchors) runs, in a sliding layer, on the Triton kernel of the same spec
    (here the reference, which honours them); a global layer, and a step without anchors, on flash."""
    monkeypatch.setattr(cuda_backend_module, "triton_attention", ReferenceAttentionKernel)
    assert CudaBackend().capabilities().window_anchors
    backend = CudaBackend()
    sliding = backend.attention(spec_of(block_size=256, window=3))
    assert isinstance(sliding, FlashAttnKernel) and isinstance(sliding._anchored, ReferenceAttentionKernel)
    assert backend.attention(spec_of(block_size=256))._anchored is None  # a global layer needs none
    spec = spec_of(block_size=4, dtype=torch.float32, window=3)
    kernel = FlashAttnKernel(spec, fake_flash_attn.flash_attn_varlen_func, None, ReferenceAttentionKernel(spec))
    torch.manual_seed(0)
    cache, query = torch.randn(2, 6, 4, 2, 8), torch.randn(3, 4, 8)
    table = torch.tensor([[2, 5]] * 3, dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             seq_lens=torch.tensor([7, 7, 7], dtype=torch.int32), block_table=table,
                             slot_mapping=torch.tensor([8, 9, 10]), num_decodes=3, max_query_len=1, max_seq_len=7,
                             query_start_loc_cpu=(0, 1, 2, 3), seq_lens_cpu=(7, 7, 7))
    anchors = dataclasses.replace(meta, window_anchors=torch.tensor([4, 5, 6], dtype=torch.int32),
                                  window_anchors_cpu=(4, 5, 6))  # an image at 4-6, as image_rows.py lays it out
    kernel.forward(query, cache, meta)
    assert len(fake_flash_attn.calls) == 1
    out = kernel.forward(query, cache, anchors)
    assert len(fake_flash_attn.calls) == 1  # not flash
    expected = paged_attention_reference(query, cache, [0, 1, 2, 3], [7, 7, 7], table, 0.35, 3,
                                         window_anchors=[4, 5, 6])
    torch.testing.assert_close(out, expected)
    without = paged_attention_reference(query, cache, [0, 1, 2, 3], [7, 7, 7], table, 0.35, 3)
    assert not torch.allclose(out[:2], without[:2])  # rows 4 and 5: their windows moved
    global_layer = FlashAttnKernel(spec_of(block_size=4, dtype=torch.float32), fake_flash_attn.flash_attn_varlen_func,
                                   None)
    global_layer.forward(query, cache, anchors)
    assert len(fake_flash_attn.calls) == 2


def test_kv_budget_follows_tgi_cuda_memory_fraction():
    profile = MemoryProfile(free_bytes=100 * GiB, total_bytes=140 * GiB, activation_peak_bytes=2 * GiB)
    assert profile.available_bytes == 98 * GiB
    assert kv_cache_budget_bytes(profile, None) == int(98 * GiB * KV_HEADROOM)  # default fraction 1.0
    assert kv_cache_budget_bytes(profile, 0.9) == int((98 - 14) * GiB * KV_HEADROOM)
    assert kv_cache_budget_bytes(profile, 0.2) == 0  # the process already uses more than 20%
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        kv_cache_budget_bytes(profile, 1.5)
    blocks = num_kv_blocks_from_profile(profile, 2 * MiB, CacheConfig(memory_fraction=0.9, max_auto_blocks=10))
    assert blocks == int((98 - 14) * GiB * KV_HEADROOM) // (2 * MiB)  # max_auto_blocks is a CPU cap
    with pytest.raises(MemoryError, match="no device memory left for the KV cache"):
        num_kv_blocks_from_profile(profile, 2 * MiB, CacheConfig(memory_fraction=0.2))


def test_profile_requests_spread_the_token_budget_over_fresh_requests():
    plan = profile_requests(num_tokens=10, num_requests=4, block_size=2)
    assert [len(s.token_ids) for s in plan.scheduled] == [3, 3, 2, 2]
    assert [s.block_ids for s in plan.scheduled] == [(1, 2), (3, 4), (5,), (6,)]
    assert all(s.samples and s.num_computed_tokens == 0 for s in plan.scheduled)
    assert len(profile_requests(num_tokens=3, num_requests=256, block_size=16).scheduled) == 3


class TokenCountingKernel(DeviceReferenceKernel):
    largest_step = 0

    def forward(self, query, kv_cache, meta):
        TokenCountingKernel.largest_step = max(TokenCountingKernel.largest_step, query.shape[0])
        return super().forward(query, kv_cache, meta)


def test_engine_sizes_the_kv_cache_from_the_profiled_free_memory():
    device = FakeDevice(free=40 * MiB, total=80 * MiB, allocated=100 * MiB, peak=101 * MiB)
    backend = CpuCudaBackend(device, kernel=TokenCountingKernel)
    engine = make_engine(backend, num_blocks=None)  # llama-tiny, fp32, block size 4, 64 batched tokens
    assert TokenCountingKernel.largest_step == 64  # the profiling step ran at max_num_batched_tokens
    profile = engine.backend.memory_profile
    assert profile == MemoryProfile(free_bytes=40 * MiB, total_bytes=80 * MiB, activation_peak_bytes=1 * MiB)
    bytes_per_block = 2 * 2 * 4 * 2 * 16 * 4  # k+v, layers, block, kv heads, head dim, fp32
    assert engine.info.num_kv_blocks == int(39 * MiB * KV_HEADROOM) // bytes_per_block
    assert device.calls.index("reset_peak_memory_stats") < device.calls.index("mem_get_info")
    assert engine.backend.available_memory_bytes() == 39 * MiB


def test_a_quantized_kv_cache_holds_more_blocks_in_the_same_memory():
    """--kv-cache-dtype int8: one byte a value and a 4-byte scale a row (head_dim 16 here: 20 bytes
    against float32's 64), so the same profiled memory holds 3.2x the blocks."""
    device = FakeDevice(free=40 * MiB, total=80 * MiB, allocated=100 * MiB, peak=101 * MiB)
    engine = make_engine(CpuCudaBackend(device, kernel=DeviceReferenceKernel), num_blocks=None, kv_cache_dtype="int8")
    bytes_per_block = 2 * 2 * 4 * 2 * (16 + 4)  # k+v, layers, block, kv heads, head dim's codes and the scale
    assert engine.info.num_kv_blocks == int(39 * MiB * KV_HEADROOM) // bytes_per_block
    assert {cache.dtype for cache in engine.runner.kv_caches} == {torch.int8}


def test_init_device_uses_local_rank_and_joins_nccl(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("device", device))
    monkeypatch.setattr(cuda_backend_module, "init_process_group",
                        lambda shard, dist_backend, device: seen.setdefault("group", (shard.rank, dist_backend, device)))
    backend = CudaBackend()
    backend.init_device(ShardInfo(rank=3, world_size=4, local_rank=1, local_world_size=2))
    assert backend.device == torch.device("cuda", 1)
    assert seen == {"device": torch.device("cuda", 1), "group": (3, "nccl", torch.device("cuda", 1))}


def test_visible_devices_follow_cuda_visible_devices():
    assert visible_device_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_device_ids({"CUDA_VISIBLE_DEVICES": "GPU-ab12, GPU-cd34"}) == ["GPU-ab12", "GPU-cd34"]
    assert visible_device_ids({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_device_ids({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_device_ids({}, device_count=lambda: 3) == ["0", "1", "2"]


def _node_shards(count: int) -> list[ShardInfo]:
    return [ShardInfo(rank, count, rank, "127.0.0.1", 29500, count) for rank in range(1, count)]


def test_launcher_refuses_more_shards_than_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(ValueError, match=r"--num-shard 2 needs 2 GPUs, but 1 is visible \(CUDA_VISIBLE_DEVICES=5\)"):
        GpuShardLauncher().start(_node_shards(2), print)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=r"--num-shard 3 needs 3 GPUs, but 2 are visible$"):
        GpuShardLauncher(device_ids=lambda: ["0", "1"]).start(_node_shards(3), print)


def _record_env(shard, out_dir: str) -> None:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
    (Path(out_dir) / f"{shard.rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))


@pytest.mark.slow
def test_launcher_starts_one_process_per_gpu_with_its_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    group = GpuShardLauncher().start(_node_shards(3), _record_env, (str(tmp_path),))
    assert group.wait(120) and group.failure() is None
    for rank in (1, 2):
        env = json.loads((tmp_path / f"{rank}.json").read_text())
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                       "CUDA_VISIBLE_DEVICES": "4,6,7"}  # shard i drives the i-th visible GPU


def test_no_communicator_without_a_process_group():
    assert CudaBackend().communicator() is None
