"""The shipped contract suite (switchyard.core.testing.BackendContract), run for the CPU
backend, the out-of-tree toy backend, and the CUDA backend on a CPU (device calls faked;
once with the fakes' reference kernel, once with the real Triton kernel under Triton's
interpreter, narrowed to float32, block size 16, GQA group 2 and 4 generated tokens, because
the interpreter is slow)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is defined

from cuda_fakes import MiB, CpuCudaBackend, FakeDevice  # noqa: E402
from switchyard.backends.cpu import CpuBackend  # noqa: E402
from switchyard.core.ops.attention import ReferenceAttentionKernel  # noqa: E402
from switchyard.core.testing import BackendContract  # noqa: E402

TOY_MODULE = Path(__file__).parent / "toy_backend_pkg" / "toy_backend.py"


class TestCpuBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return CpuBackend()


def _toy_backend_class():
    """The toy plugin's module, loaded from its file as an installed plugin's would be imported."""
    spec = importlib.util.spec_from_file_location("toy_backend", TOY_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ToyBackend


class TestToyBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return _toy_backend_class()()


def _small_device() -> FakeDevice:
    return FakeDevice(free=8 * MiB, total=64 * MiB, allocated=100 * MiB, peak=101 * MiB)  # a small KV cache


class TestCudaBackendOnFakes(BackendContract):
    @pytest.fixture
    def backend(self):
        return CpuCudaBackend(_small_device())


def _triton_interprets_here() -> bool:
    """Triton chooses interpreter or compiler when a kernel is defined: if it was imported
    before TRITON_INTERPRET was set (another test module), its kernels cannot run on a CPU."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.zeros, InterpretedFunction)


@pytest.mark.skipif(torch.cuda.is_available() or not _triton_interprets_here(),
                    reason="needs Triton's interpreter, set before triton was first imported")
class TestCudaBackendTritonKernel(BackendContract):
    dtypes_to_test = ("float32",)
    block_sizes_to_test = (16,)
    gqa_groups = (2,)
    generated_tokens = 4

    @pytest.fixture
    def backend(self):
        from switchyard.backends.cuda.attention import TritonAttentionKernel

        return CpuCudaBackend(_small_device(), kernel=lambda spec: TritonAttentionKernel(spec, num_sms=1))


# -- the suite fails a backend that breaks the contract ---------------------------------------------
class OffKernel(ReferenceAttentionKernel):
    """1% off the reference; its write_kv also writes one slot too far."""

    def write_kv(self, key, value, kv_cache, meta) -> None:
        super().write_kv(key, value, kv_cache, replace(meta, slot_mapping=meta.slot_mapping + 1))

    def forward(self, query, kv_cache, meta):
        return super().forward(query, kv_cache, meta) * 1.01


class LyingKernel(ReferenceAttentionKernel):
    graph_safe = True  # but it reads the metadata's host tuples


class BrokenBackend(CpuBackend):
    def __init__(self, kernel):
        super().__init__(pack_weights=False)
        self._kernel = kernel

    def attention(self, spec):
        return self._kernel(spec)

    def prepare_model(self, loaded, config) -> None:
        with torch.no_grad():
            loaded.model.lm_head.weight.neg_()  # a repacking that went wrong


@pytest.mark.parametrize("test, kernel", [
    ("test_attention_matches_the_reference_on_ragged_batches", OffKernel),
    ("test_write_kv_writes_exactly_the_slots_of_slot_mapping", OffKernel),
    ("test_a_graph_safe_kernel_reads_no_host_tuples_on_decode_batches", LyingKernel),
    ("test_engine_greedy_output_equals_the_reference_backend", ReferenceAttentionKernel),
])
def test_the_suite_fails_a_backend_that_breaks_the_contract(test, kernel):
    contract = TestCpuBackend()
    contract.dtypes_to_test, contract.block_sizes_to_test, contract.gqa_groups = ("float32",), (8,), (2,)
    with pytest.raises(Exception):  # noqa: B017 - a failed assertion, or a kernel that crashes
        getattr(contract, test)(BrokenBackend(kernel))
