"""The engine enforces what a backend declares (core/capabilities.py): a dtype, block size or
quantized KV cache it does not list is refused in one line, before anything loads, from the engine, the
offline LLM and `switchyard serve`; prefix caching and mixed steps it cannot do are
turned off with a logged line."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from switchyard.backends.cpu import CpuBackend
from switchyard.core.backend import Capabilities
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.errors import BackendCapabilityError
from switchyard.core.plugins import BackendError, check_backend
from switchyard.gateway.cli import main

CAPS = Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(16, 32), attention_impl="test")
TINY = ModelConfig(model="llama-tiny", load_format="dummy")


def test_a_configuration_the_backend_serves_is_returned_unchanged():
    config = EngineConfig(model=TINY, cache=CacheConfig(block_size=32))
    assert check_capabilities("b", CAPS, config) is config


def test_a_gguf_is_dequantized_on_a_backend_without_gguf_kernels():
    settled = check_capabilities("b", CAPS, EngineConfig())
    assert settled.model.quantize == "none"
    assert check_capabilities("b", CAPS, settled) == settled  # decided once: the same again


def test_an_undeclared_dtype_is_refused_naming_backend_value_and_supported():
    config = EngineConfig(model=ModelConfig(dtype="float16"))
    with pytest.raises(BackendCapabilityError) as error:
        check_capabilities("b", CAPS, config)
    assert str(error.value) == "backend 'b' does not support dtype 'float16'; it supports: float32, bfloat16"
    assert isinstance(error.value, BackendError)  # printed as one line, exit 2, like other backend errors


def test_an_undeclared_block_size_is_refused():
    with pytest.raises(BackendCapabilityError, match=r"^backend 'b' does not support KV block size 8; "
                                                     r"it supports: 16, 32$"):
        check_capabilities("b", CAPS, EngineConfig(cache=CacheConfig(block_size=8)))


def test_an_undeclared_kv_cache_dtype_is_refused_in_one_line():
    with pytest.raises(BackendCapabilityError, match=r"^backend 'b' does not support --kv-cache-dtype int8; "
                                                     r"it supports: auto$"):
        check_capabilities("b", CAPS, EngineConfig(model=TINY, cache=CacheConfig(kv_cache_dtype="int8")))
    caps = replace(CAPS, kv_cache_dtypes=("int8",))
    with pytest.raises(BackendCapabilityError, match=r"--kv-cache-dtype fp8_e5m2; it supports: auto, int8$"):
        check_capabilities("b", caps, EngineConfig(model=TINY, cache=CacheConfig(kv_cache_dtype="fp8_e5m2")))
    declared = EngineConfig(model=TINY, cache=CacheConfig(kv_cache_dtype="int8"))
    assert check_capabilities("b", caps, declared) is declared


class NoQuantizedKvCpu(CpuBackend):
    """The CPU backend declaring no quantized KV cache."""

    def __init__(self):
        super().__init__(pack_weights=False)
        self.loaded_models = 0

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), kv_cache_dtypes=())

    def init_device(self, shard=None) -> None:
        self.loaded_models += 1


def test_the_engine_refuses_a_kv_cache_dtype_before_loading():
    backend = NoQuantizedKvCpu()
    with pytest.raises(BackendCapabilityError, match="does not support --kv-cache-dtype fp8_e4m3fn; it supports: auto$"):
        EngineCore(EngineConfig(model=TINY, cache=CacheConfig(num_blocks=8, kv_cache_dtype="fp8_e4m3fn")),
                   backend=backend)
    assert backend.loaded_models == 0


def test_the_cpu_backend_reads_every_quantized_kv_cache():
    assert CpuBackend().capabilities().kv_cache_dtypes == ("int8", "fp8_e4m3fn", "fp8_e5m2")


def test_auto_dtype_becomes_the_backends_preferred_one():
    settled = check_capabilities("b", replace(CAPS, preferred_dtype="bfloat16"),
                                 EngineConfig(model=ModelConfig(dtype="auto")))
    assert settled.model.dtype == "bfloat16"


def test_auto_dtype_is_float32_for_integer_multiplied_weights_and_follows_a_forced_level():
    caps = replace(CAPS, preferred_dtype="bfloat16", quantizations=("gguf",), integer_quantizations=("gguf",),
                   isa_levels=(("avx2", "float32"), ("avx512-vnni", "bfloat16")))
    gguf = check_capabilities("b", caps, EngineConfig(model=ModelConfig(dtype="auto")))
    assert (gguf.model.quantize, gguf.model.dtype) == ("gguf", "float32")
    floats = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", dtype="auto"))
    assert check_capabilities("b", caps, floats).model.dtype == "bfloat16"
    assert check_capabilities("b", caps, replace(floats, isa="avx2")).model.dtype == "float32"


def test_a_vision_tower_beside_integer_weights_takes_the_backends_float_dtype():
    """The language model's float32 is for its integer products; a tower's float weights take what the
    backend prefers for floats (at the level asked). An explicit --dtype, or vision_dtype, holds."""
    caps = replace(CAPS, preferred_dtype="bfloat16", quantizations=("gguf",), integer_quantizations=("gguf",),
                   isa_levels=(("avx2", "float32"), ("avx512-vnni", "bfloat16")))
    pair = EngineConfig(model=ModelConfig(dtype="auto"))
    settled = check_capabilities("b", caps, pair).model
    assert (settled.dtype, settled.vision_dtype) == ("float32", "bfloat16")
    assert check_capabilities("b", caps, replace(pair, isa="avx2")).model.vision_dtype == "float32"
    assert check_capabilities("b", caps, EngineConfig(model=ModelConfig(dtype="float32"))).model.vision_dtype == "auto"
    chosen = EngineConfig(model=ModelConfig(dtype="auto", vision_dtype="float32"))
    assert check_capabilities("b", caps, chosen).model.vision_dtype == "float32"
    floats = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", dtype="auto"))
    assert check_capabilities("b", caps, floats).model.vision_dtype == "auto"  # the model's dtype, bfloat16
    with pytest.raises(BackendCapabilityError, match="dtype 'float16'"):
        check_capabilities("b", caps, EngineConfig(model=ModelConfig(dtype="auto", vision_dtype="float16")))


def test_an_instruction_set_level_the_backend_cannot_run_is_refused_in_one_line():
    caps = replace(CAPS, isa_levels=(("portable", "float32"), ("avx2", "float32")))
    with pytest.raises(BackendCapabilityError, match=r"^backend 'b' cannot run at instruction-set level 'amx' here; "
                                                     r"it can: auto, portable, avx2$"):
        check_capabilities("b", caps, EngineConfig(model=TINY, isa="amx"))
    with pytest.raises(BackendCapabilityError, match="it can: auto$"):
        check_capabilities("b", CAPS, EngineConfig(model=TINY, isa="avx2"))


def test_an_undeclared_quantization_is_refused_in_one_line():
    with pytest.raises(BackendCapabilityError, match=r"^backend 'b' does not support --quantize awq; "
                                                     r"it supports: int8, gguf$"):
        check_capabilities("b", replace(CAPS, quantizations=("int8", "gguf")),
                           EngineConfig(model=ModelConfig(quantize="awq")))
    with pytest.raises(BackendCapabilityError, match=r"it supports: \(none\)$"):
        check_capabilities("b", CAPS, EngineConfig(model=ModelConfig(quantize="int8")))


def test_prefix_caching_and_mixed_steps_are_turned_off_with_a_logged_line(caplog):
    caps = replace(CAPS, prefix_caching=False, mixed_prefill_decode=False)
    with caplog.at_level(logging.INFO, logger="switchyard.core.capabilities"):
        settled = check_capabilities("b", caps, EngineConfig())
    assert not settled.cache.enable_prefix_caching and not settled.scheduler.mixed_prefill_decode
    assert "prefix caching off: backend 'b' does not support it" in caplog.text
    assert "backend 'b' cannot mix them" in caplog.text
    caplog.clear()
    off = EngineConfig(model=TINY, cache=CacheConfig(enable_prefix_caching=False))
    with caplog.at_level(logging.INFO, logger="switchyard.core.capabilities"):
        assert check_capabilities("b", replace(CAPS, prefix_caching=False), off) is off
    assert caplog.text == ""  # nothing was asked that the backend cannot do


class NarrowCpu(CpuBackend):
    """The CPU backend declaring less than it can do."""

    name = "narrow-cpu"

    def __init__(self):
        super().__init__(pack_weights=False)
        self.loaded_models = 0

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), block_sizes=(16,), prefix_caching=False, mixed_prefill_decode=False)

    def init_device(self, shard=None) -> None:
        self.loaded_models += 1  # the engine got past its checks


def test_the_engine_refuses_before_loading_and_narrows_what_it_runs():
    backend = NarrowCpu()
    with pytest.raises(BackendCapabilityError, match="'narrow-cpu' does not support KV block size 4"):
        EngineCore(EngineConfig(model=TINY, cache=CacheConfig(block_size=4, num_blocks=8)), backend=backend)
    assert backend.loaded_models == 0
    engine = EngineCore(EngineConfig(model=TINY, cache=CacheConfig(num_blocks=8)), backend=backend)
    assert not engine.config.cache.enable_prefix_caching and not engine.config.scheduler.mixed_prefill_decode
    assert not engine.scheduler.kv_cache_manager.enable_prefix_caching
    assert engine.scheduler.prefill_policy is not None  # prefill-only / decode-only steps
    engine.shutdown()


def test_check_backend_selects_and_checks_without_loading():
    assert check_backend(EngineConfig(backend="cpu")).cache.enable_prefix_caching
    with pytest.raises(BackendCapabilityError, match="'cpu' does not support dtype 'float16'"):
        check_backend(EngineConfig(model=ModelConfig(dtype="float16"), backend="cpu"))


def test_offline_llm_raises_it():
    from switchyard.core import LLM

    with pytest.raises(BackendCapabilityError, match="backend 'cpu' does not support dtype 'float16'"):
        LLM(backend="cpu", dtype="float16")


@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["generate", "hi"]])
def test_the_cli_says_it_in_one_line_and_exits_2(command, capsys):
    assert main(command + ["--backend", "cpu", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("switchyard: error:")]
    assert errors == [("switchyard: error: backend 'cpu' does not support dtype 'float16'; "
                       "it supports: float32, bfloat16")] and "Traceback" not in err


def test_partial_prefix_hits_are_off_where_the_backend_cannot_copy_slots():
    settled = check_capabilities("b", replace(CAPS, partial_prefix_hits=False), EngineConfig())
    assert settled.cache.enable_prefix_caching and not settled.cache.partial_prefix_hits
    assert check_capabilities("b", CAPS, EngineConfig()).cache.partial_prefix_hits
