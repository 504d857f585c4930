"""The shipped contract suite (switchyard.core.testing.BackendContract), run for the CPU
backend, the out-of-tree toy backend, and the CUDA backend on a CPU (device calls faked, its
own attention kernels: Triton under Triton's interpreter, narrowed to float32, block size 16,
GQA group 2 and 4 generated tokens, because the interpreter is slow). Then the suite itself:
every one of its checks fails a backend that breaks what it checks (broken_backends.py; an
AssertionError, not any error, and not a skip) and passes the same backend that keeps it; a
check added to the suite without its broken backend fails here."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is defined

from broken_backends import (AlwaysCommunicator, AnchorBlindKernel, BatchDependentLoraKernel,  # noqa: E402
                             DeviceName, ImageBlind, KernelBackend, LoraKernelBackend, LoraWithoutKernel, LyingKernel,
                             MisspelledDtype, NegatedHead, NoLauncher, OffKernel, OneKvBlock, RaisingProbe,
                             ScalelessKvKernel, SharedKvCache, UnscaledLoraKernel, VerifyOnLastRow)
from cuda_fakes import CUDA_KERNEL, MiB, CpuCudaBackend, DeviceReferenceKernel, FakeDevice  # noqa: E402
from switchyard.backends.cpu import CpuBackend  # noqa: E402
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
# check -> the backend that breaks what it checks (broken_backends.py); every check has one
BREACHES = {
    "test_probe_returns_a_probe_result_and_never_raises": RaisingProbe,
    "test_capabilities_are_well_formed": MisspelledDtype,
    "test_device_holds_tensors": DeviceName,
    "test_allocate_kv_cache_layout": SharedKvCache,
    "test_write_kv_writes_exactly_the_slots_of_slot_mapping": lambda: KernelBackend(OffKernel),
    "test_attention_matches_the_reference_on_ragged_batches": lambda: KernelBackend(OffKernel),
    "test_declared_kv_cache_dtypes_round_trip_through_write_kv_and_attention": lambda: KernelBackend(ScalelessKvKernel),
    "test_a_graph_safe_kernel_reads_no_host_tuples_on_decode_batches": lambda: KernelBackend(LyingKernel),
    "test_declared_window_anchors_move_sliding_windows_as_the_reference": lambda: KernelBackend(AnchorBlindKernel),
    "test_lora_is_declared_exactly_when_there_is_a_lora_kernel": LoraWithoutKernel,
    "test_lora_kernel_matches_the_reference": lambda: LoraKernelBackend(UnscaledLoraKernel()),
    "test_lora_kernel_gives_a_token_the_same_output_alone_as_in_the_batch":
        lambda: LoraKernelBackend(BatchDependentLoraKernel()),
    "test_engine_greedy_output_equals_the_reference_backend": NegatedHead,
    "test_speculative_verify_steps_give_the_plain_greedy_tokens": VerifyOnLastRow,
    "test_declared_vision_encoders_answer_images_as_the_reference_backend": ImageBlind,
    "test_num_kv_blocks_is_at_least_two": OneKvBlock,
    "test_no_communicator_when_unsharded": AlwaysCommunicator,
    "test_a_shard_launcher_exactly_when_there_is_a_dist_backend": NoLauncher,
}
# check -> the same backend keeping the contract, where that is not the reference kernel's
KEPT = {"test_a_graph_safe_kernel_reads_no_host_tuples_on_decode_batches": lambda: KernelBackend(DeviceReferenceKernel)}
CHECKS = sorted(name for name in vars(BackendContract) if name.startswith("test_"))


def test_every_check_of_the_suite_has_a_broken_backend():
    assert set(BREACHES) == set(CHECKS), "each check of BackendContract needs its broken backend in BREACHES"


def _run_check(check: str, backend) -> None:
    """The check on a narrowed CPU contract; a skip fails (it would prove nothing either way)."""
    contract = TestCpuBackend()
    contract.dtypes_to_test, contract.block_sizes_to_test, contract.gqa_groups = ("float32",), (8,), (2,)
    try:
        getattr(contract, check)(backend)
    except pytest.skip.Exception as skipped:
        pytest.fail(f"{check} was skipped: {skipped}")


@pytest.mark.parametrize("check", CHECKS)
def test_the_suite_fails_a_backend_that_breaks_the_contract(check):
    assert check in BREACHES, f"{check} has no broken backend in BREACHES"
    with pytest.raises(AssertionError):
        _run_check(check, BREACHES[check]())


@pytest.mark.parametrize("check", CHECKS)
def test_the_suite_passes_the_same_backend_when_it_keeps_the_contract(check):
    _run_check(check, KEPT.get(check, KernelBackend)())
