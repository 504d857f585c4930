"""The shipped contract suite (switchyard.core.testing.BackendContract), run for the CPU
backend, the out-of-tree toy backend, and the CUDA backend on a CPU (device calls faked, its
own attention kernels: Triton under Triton's interpreter, narrowed to float32, block size 16,
GQA group 2 and 4 generated tokens, because the interpreter is slow). Then the suite itself:
each of its checks fails a backend that breaks what it checks (an AssertionError, not any
error) and passes the same backend that keeps it."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is defined

from cuda_fakes import CUDA_KERNEL, MiB, CpuCudaBackend, DeviceReferenceKernel, FakeDevice  # noqa: E402
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
class TestCudaBackendOnFakes(BackendContract):
    """The CUDA backend's own attention path (CudaBackend.attention: its Triton kernel here, where
    flash-attn is not installed) against the reference, on fake device calls; narrowed because
    the interpreter is slow."""

    dtypes_to_test = ("float32",)
    block_sizes_to_test = (16,)
    gqa_groups = (2,)
    generated_tokens = 4

    @pytest.fixture
    def backend(self):
        return CpuCudaBackend(_small_device(), kernel=CUDA_KERNEL)

    def test_the_kernels_are_the_cuda_backends_own(self, backend):
        from switchyard.backends.cuda.attention import TritonAttentionKernel
        from switchyard.backends.cuda.flash import FlashAttnKernel

        kernel = backend.attention(self.spec("float32", 16, 2))
        assert isinstance(kernel, (TritonAttentionKernel, FlashAttnKernel)), type(kernel)


# -- the suite fails a backend that breaks the contract, and passes the same one that keeps it ------
class OffKernel(ReferenceAttentionKernel):
    """1% off the reference; its write_kv also writes one slot too far."""

    def write_kv(self, key, value, kv_cache, meta) -> None:
        super().write_kv(key, value, kv_cache, replace(meta, slot_mapping=meta.slot_mapping + 1))

    def forward(self, query, kv_cache, meta):
        return super().forward(query, kv_cache, meta) * 1.01


class LyingKernel(ReferenceAttentionKernel):
    graph_safe = True  # but it reads the metadata's host tuples


class KernelBackend(CpuBackend):
    """The CPU backend over the given kernel; `break_head`: its prepare_model also negates the
    LM head (a repacking that went wrong)."""

    def __init__(self, kernel, break_head: bool = False):
        super().__init__(pack_weights=False)
        self._kernel = kernel
        self.break_head = break_head

    def attention(self, spec):
        return self._kernel(spec)

    def prepare_model(self, loaded, config) -> None:
        super().prepare_model(loaded, config)
        if self.break_head:
            with torch.no_grad():
                loaded.model.lm_head.weight.neg_()


# (test, a backend that breaks what it checks, the same backend keeping it); made per test
BREACHES = [
    ("test_attention_matches_the_reference_on_ragged_batches", lambda: KernelBackend(OffKernel),
     lambda: KernelBackend(ReferenceAttentionKernel)),
    ("test_write_kv_writes_exactly_the_slots_of_slot_mapping", lambda: KernelBackend(OffKernel),
     lambda: KernelBackend(ReferenceAttentionKernel)),
    ("test_a_graph_safe_kernel_reads_no_host_tuples_on_decode_batches", lambda: KernelBackend(LyingKernel),
     lambda: KernelBackend(DeviceReferenceKernel)),
    ("test_engine_greedy_output_equals_the_reference_backend",
     lambda: KernelBackend(ReferenceAttentionKernel, break_head=True), lambda: KernelBackend(ReferenceAttentionKernel)),
]


def _narrow_contract() -> BackendContract:
    contract = TestCpuBackend()
    contract.dtypes_to_test, contract.block_sizes_to_test, contract.gqa_groups = ("float32",), (8,), (2,)
    return contract


@pytest.mark.parametrize("test, broken, _", BREACHES, ids=[case[0] for case in BREACHES])
def test_the_suite_fails_a_backend_that_breaks_the_contract(test, broken, _):
    with pytest.raises(AssertionError):
        getattr(_narrow_contract(), test)(broken())


@pytest.mark.parametrize("test, _, kept", BREACHES, ids=[case[0] for case in BREACHES])
def test_the_suite_passes_the_same_backend_when_it_keeps_the_contract(test, _, kept):
    try:
        getattr(_narrow_contract(), test)(kept())
    except pytest.skip.Exception as skipped:  # a control that skips would prove nothing
        pytest.fail(f"the control was skipped: {skipped}")
