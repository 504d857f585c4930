"""The CPU KV cache is sized from the configuration, never from the memory free at start
(core/kv/sizing.py), says its size in one line, and refuses, in one line, a cache that does
not fit. A quantized cache (--kv-cache-dtype) holds about 3.8x the tokens in the same bytes."""
from __future__ import annotations

import logging

import pytest
import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu import backend as cpu_backend_module
from switchyard.core.backend import AttentionSpec
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.kv.sizing import (DEFAULT_KV_TOKENS, KVCacheSize, KVCacheTooLarge, blocks_for_tokens,
                                       parse_memory_size, with_usable_tokens)
from switchyard.gateway.cli import build_parser, main
from switchyard.gateway.serve import engine_config

GiB = 2**30
BYTES_PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4  # the default model's block in float32: 30 layers, 3 KV heads of 64


def _free(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(cpu_backend_module, "_meminfo_available_bytes", lambda: nbytes)


@pytest.mark.parametrize("free", [2 * GiB, 20 * GiB, 200 * GiB])
def test_the_default_cache_does_not_follow_free_memory(monkeypatch, free):
    """It was 30% of the free memory (up to 16,384 blocks): 140k tokens on an idle machine,
    1,680 on a busy one. Now the same 16,384 tokens on every machine they fit on."""
    _free(monkeypatch, free)
    blocks = CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, CacheConfig())
    assert blocks == blocks_for_tokens(DEFAULT_KV_TOKENS, 16) == DEFAULT_KV_TOKENS // 16 + 1


def test_the_default_is_what_the_configuration_can_hold_when_that_is_less(monkeypatch):
    _free(monkeypatch, 200 * GiB)
    cache = with_usable_tokens(CacheConfig(), max_num_seqs=2, max_model_len=2048)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, cache) == 4096 // 16 + 1
    many = with_usable_tokens(CacheConfig(), max_num_seqs=256, max_model_len=8192)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, many) == DEFAULT_KV_TOKENS // 16 + 1


def test_the_default_holds_one_request_of_a_context_longer_than_it(monkeypatch):
    _free(monkeypatch, 200 * GiB)
    long = with_usable_tokens(CacheConfig(), max_num_seqs=256, max_model_len=32768)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, long) == 32768 // 16 + 1


def test_kv_cache_memory_sets_the_size_in_bytes_up_to_what_the_configuration_holds(monkeypatch):
    _free(monkeypatch, 200 * GiB)
    cache = with_usable_tokens(CacheConfig(kv_cache_memory=4 * GiB), max_num_seqs=256, max_model_len=8192)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, cache) == 4 * GiB // BYTES_PER_BLOCK  # like vLLM-CPU's space
    small = with_usable_tokens(CacheConfig(kv_cache_memory=4 * GiB), max_num_seqs=1, max_model_len=1024)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, small) == 1024 // 16 + 1  # never more than it can use


def test_a_cache_that_does_not_fit_is_refused_in_one_line(monkeypatch):
    _free(monkeypatch, 100 << 20)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, scale=0.125)
    with pytest.raises(KVCacheTooLarge) as refused:
        CpuBackend().allocate_kv_cache(30, 1025, spec)  # 0.5 GB in float32
    message = str(refused.value)
    assert "\n" not in message and "16,384 tokens" in message and "0.10 GB of memory available" in message
    assert "--max-batch-total-tokens" in message
    assert len(CpuBackend().allocate_kv_cache(2, 65, spec)) == 2  # what fits is allocated


def _tiny(cache: CacheConfig, max_num_seqs: int = 8) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", max_model_len=512),
                        cache=cache, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))


def test_an_engine_logs_its_cache_in_gb_and_tokens(monkeypatch, caplog):
    _free(monkeypatch, 200 * GiB)
    with caplog.at_level(logging.INFO, logger="switchyard.core.engine.core"):
        engine = EngineCore(_tiny(CacheConfig(block_size=16), max_num_seqs=4), backend=CpuBackend())
    try:
        assert engine.info.max_batch_total_tokens == 4 * 512  # 4 requests of the whole context
        bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers, 2 KV heads of 16, float32
        size = KVCacheSize(4 * 512 // 16 + 1, 16, (4 * 512 // 16 + 1) * bytes_per_block, "float32")
        assert f"engine ready: backend=cpu, {size.describe()}" in caplog.messages
        assert size.describe() == "KV cache: 0.00 GB, 2,048 tokens (129 blocks of 16, float32)"
    finally:
        engine.shutdown()


def test_an_engine_whose_configured_cache_does_not_fit_refuses_to_start(monkeypatch):
    _free(monkeypatch, 1 << 20)  # 1 MiB free: the weights fit, 100k blocks of 4 KiB do not
    with pytest.raises(KVCacheTooLarge, match="more than the 0.00 GB of memory available"):
        EngineCore(_tiny(CacheConfig(block_size=16, num_blocks=100_000)), backend=CpuBackend())


def test_generate_refuses_a_cache_that_does_not_fit_in_one_line(monkeypatch, capsys):
    _free(monkeypatch, 1 << 20)
    code = main(["generate", "--model-id", "llama-tiny", "--load-format", "dummy", "--backend", "cpu",
                 "--num-kv-blocks", "100000", "--raw", "hi"])
    err = capsys.readouterr().err  # the loading's log lines, then the error
    assert code == 2 and err.splitlines()[-1].startswith("switchyard: error: the KV cache of 1,599,984 tokens needs")
    assert "Traceback" not in err and sum("error" in line for line in err.splitlines()) == 1


@pytest.mark.parametrize("text, size", [("4GiB", 4 * GiB), ("512MB", 512 * 10**6), ("1.5G", 3 * GiB // 2),
                                        ("4096", 4096), ("64 KiB", 64 << 10), ("2gb", 2 * 10**9)])
def test_memory_sizes(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "4 parsecs", "-1G", "0"])
def test_bad_memory_sizes(text):
    with pytest.raises(ValueError):
        parse_memory_size(text)


def test_the_kv_cache_memory_flag_reaches_the_cache_config(capsys):
    args = build_parser({}).parse_args(["serve", "--kv-cache-memory", "512MiB"])
    assert engine_config(args).cache.kv_cache_memory == 512 << 20
    assert engine_config(build_parser({"KV_CACHE_MEMORY": "1G"}).parse_args(["serve"])).cache.kv_cache_memory == GiB
    assert engine_config(build_parser({}).parse_args(["serve"])).cache.kv_cache_memory is None
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--kv-cache-memory", "lots"])
    assert "argument --kv-cache-memory: not a memory size: 'lots'" in capsys.readouterr().err


def test_a_bfloat16_model_has_a_bfloat16_cache(monkeypatch, caplog):
    """The cache takes the model's dtype: a model run in bfloat16 holds half the bytes per token."""
    _free(monkeypatch, 200 * GiB)
    config = _tiny(CacheConfig(block_size=16), max_num_seqs=4)
    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", max_model_len=512,
                                            dtype="bfloat16"), cache=config.cache, scheduler=config.scheduler)
    with caplog.at_level(logging.INFO, logger="switchyard.core.engine.core"):
        engine = EngineCore(config, backend=CpuBackend())
    try:
        assert {c.dtype for c in engine.runner.kv_caches} == {torch.bfloat16}
        assert any(m.endswith("(129 blocks of 16, bfloat16)") for m in caplog.messages)
    finally:
        engine.shutdown()


def test_an_engine_process_refuses_in_one_line_without_a_traceback(caplog):
    """What `switchyard serve` logs from its engine process for a cache that does not fit."""
    from switchyard.core.engine.channel import queue_pair
    from switchyard.core.engine.loop import serve_engine
    from switchyard.core.engine.messages import StartupFailed

    def refused():
        raise KVCacheTooLarge("the KV cache of 16,384 tokens needs 0.75 GB, more than the 0.10 GB available")

    owner, engine_end = queue_pair()
    with caplog.at_level(logging.INFO, logger="switchyard.core.engine.loop"):
        serve_engine(engine_end, refused)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == ("engine start-up refused: the KV cache of 16,384 tokens needs 0.75 GB, "
                                   "more than the 0.10 GB available") and record.exc_info is None
    event = owner.recv(5)
    assert isinstance(event, StartupFailed) and isinstance(event.error, KVCacheTooLarge)


def test_a_cache_smaller_than_the_context_is_said(monkeypatch, caplog):
    _free(monkeypatch, 200 * GiB)
    with caplog.at_level(logging.WARNING, logger="switchyard.core.engine.core"):
        engine = EngineCore(_tiny(CacheConfig(block_size=16, num_blocks=9)), backend=CpuBackend())
    engine.shutdown()
    assert "the KV cache holds 128 tokens, fewer than the context of 512: a longer request is refused" \
        in caplog.messages


def _mapping_of(tensor: torch.Tensor, smaps: str = "/proc/self/smaps") -> dict[str, str]:
    """The smaps fields (Rss, VmFlags, ...) of the mapping that holds `tensor`'s first byte."""
    address, fields, inside = tensor.data_ptr(), {}, False
    with open(smaps) as file:
        for line in file:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_the_cache_fills_in_a_small_page_at_a_time():
    """One used block makes a few KiB of a layer's cache resident, not a 2 MiB huge page (numpy's
    zeros advised huge pages: the warm-up alone made ~60 MB of the default model's cache resident)."""
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125, dtype=torch.bfloat16)
    layer = CpuBackend().allocate_kv_cache(1, 1025, spec)[0]  # 12 MiB, as one of the default model's 30
    assert layer.shape == (2, 1025, 16, 3, 64)
    layer[:, 1] = 1.0  # one block's keys and values
    mapping = _mapping_of(layer)
    assert "nh" in mapping["VmFlags"].split() and "hg" not in mapping["VmFlags"].split()
    assert int(mapping["Rss"].split()[0]) <= 64  # KiB
    assert layer[:, 1].eq(1).all() and not layer[:, 0].any() and not layer[:, 2:].any()  # the rest: zeros


INT8_BYTES_PER_BLOCK = 2 * 30 * 16 * 3 * (64 + 4)  # the default model's block in int8: 64 codes and a scale a row


def test_a_quantized_cache_holds_more_tokens_in_the_default_budget(monkeypatch):
    """The automatic budget is DEFAULT_KV_TOKENS tokens' bytes in the model's dtype: an 8-bit cache
    holds 3.76x the tokens in them (61,680 for the default model), still no more than the
    configuration can use."""
    _free(monkeypatch, 200 * GiB)
    many = with_usable_tokens(CacheConfig(kv_cache_dtype="int8"), max_num_seqs=256, max_model_len=8192,
                              model_dtype_block_bytes=BYTES_PER_BLOCK)
    blocks = CpuBackend().num_kv_blocks(INT8_BYTES_PER_BLOCK, many)
    assert blocks == DEFAULT_KV_TOKENS // 16 * BYTES_PER_BLOCK // INT8_BYTES_PER_BLOCK + 1 == 3856
    assert (blocks - 1) * INT8_BYTES_PER_BLOCK <= DEFAULT_KV_TOKENS // 16 * BYTES_PER_BLOCK  # the same bytes
    few = with_usable_tokens(CacheConfig(kv_cache_dtype="int8"), max_num_seqs=2, max_model_len=2048,
                             model_dtype_block_bytes=BYTES_PER_BLOCK)
    assert CpuBackend().num_kv_blocks(INT8_BYTES_PER_BLOCK, few) == 4096 // 16 + 1
    same = with_usable_tokens(CacheConfig(), max_num_seqs=256, max_model_len=8192,
                              model_dtype_block_bytes=BYTES_PER_BLOCK)
    assert CpuBackend().num_kv_blocks(BYTES_PER_BLOCK, same) == DEFAULT_KV_TOKENS // 16 + 1  # auto: as before


def test_kv_cache_memory_holds_more_tokens_in_a_quantized_cache(monkeypatch):
    _free(monkeypatch, 200 * GiB)
    cache = with_usable_tokens(CacheConfig(kv_cache_memory=GiB, kv_cache_dtype="fp8_e4m3fn"), max_num_seqs=256,
                               max_model_len=8192, model_dtype_block_bytes=BYTES_PER_BLOCK)
    assert CpuBackend().num_kv_blocks(INT8_BYTES_PER_BLOCK, cache) == GiB // INT8_BYTES_PER_BLOCK
    assert GiB // INT8_BYTES_PER_BLOCK > 3.7 * (GiB // BYTES_PER_BLOCK)


@pytest.mark.parametrize("kv_cache_dtype,code", [("int8", torch.int8), ("fp8_e4m3fn", torch.float8_e4m3fn),
                                                 ("fp8_e5m2", torch.float8_e5m2)])
def test_an_engine_with_a_quantized_cache_says_its_format_bytes_and_tokens(monkeypatch, caplog, kv_cache_dtype, code):
    """The start line counts the quantized cache's bytes and the tokens its budget holds: llama-tiny's
    2 layers of 2 KV heads of 16, 20 bytes a row against float32's 64."""
    _free(monkeypatch, 200 * GiB)
    config = _tiny(CacheConfig(block_size=16, kv_cache_dtype=kv_cache_dtype), max_num_seqs=256)
    with caplog.at_level(logging.INFO, logger="switchyard.core.engine.core"):
        engine = EngineCore(config, backend=CpuBackend())
    try:
        float_blocks = DEFAULT_KV_TOKENS // 16  # 256 x 512 tokens is more than the budget holds
        blocks = float_blocks * (2 * 2 * 16 * 2 * 64) // (2 * 2 * 16 * 2 * 20) + 1
        assert engine.info.num_kv_blocks == blocks and engine.info.max_batch_total_tokens == (blocks - 1) * 16
        size = KVCacheSize(blocks, 16, blocks * 2 * 2 * 16 * 2 * 20, kv_cache_dtype)
        assert f"engine ready: backend=cpu, {size.describe()}" in caplog.messages
        assert size.describe().endswith(f"tokens ({blocks:,} blocks of 16, {kv_cache_dtype})")
        assert {(c.dtype, c.shape[-1]) for c in engine.runner.kv_caches} == {(code, 20)}
    finally:
        engine.shutdown()


def test_the_kv_cache_dtype_flag_reaches_the_cache_config(capsys):
    assert engine_config(build_parser({}).parse_args(["serve"])).cache.kv_cache_dtype == "auto"
    args = build_parser({}).parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config(args).cache.kv_cache_dtype == "fp8_e5m2"
    from_env = build_parser({"KV_CACHE_DTYPE": "int8"}).parse_args(["serve"])  # TGI's variable
    assert engine_config(from_env).cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--kv-cache-dtype", "q4_0"])
    assert "argument --kv-cache-dtype: invalid choice: 'q4_0'" in capsys.readouterr().err
