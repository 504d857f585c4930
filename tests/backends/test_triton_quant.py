"""Quantized weights on the CUDA backend (backends/cuda/quant.py): the Triton dequantize-GEMM
(kernels/dequant_gemm.py) over the layout of packed_codes.py, for every ggml block format, int8,
fused parts and act-order, against the independent reference (QuantizedWeight.dequantize, then a
torch matmul) on ragged shapes; the kernel choice (Marlin, fp8, bitsandbytes) where it can be made
without a GPU; and a tiny random Llama quantized at load, its linears swapped by the CUDA backend's
prepare_model, greedy-equal to the same weights on core's dequantizing path.

Without a GPU the kernels run under Triton's interpreter (see test_triton_kernels.py: the
interpreter is switched on before triton is imported, and a fresh process reruns this file when
some other module imported triton first), so shapes stay small.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from triton_interpreter import DEVICE, ON_GPU, RUNS_HERE, rerun_in_fresh_process, skip_unless_runnable  # noqa: E402  (first: sets TRITON_INTERPRET)

from switchyard.core.quant import QuantizedWeight, quantize_int8  # noqa: E402
from switchyard.core.quant.hub.blocks import to_quantized  # noqa: E402
from switchyard.core.quant.parts import QuantizedParts  # noqa: E402
from switchyard.core.testing.quant_blocks import BLOCK_FORMATS, random_blocks  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_working_kernels(request):
    skip_unless_runnable(request)


from switchyard.backends.cuda import quant  # noqa: E402
from switchyard.backends.cuda.graphs import graph_unsafe_kernels  # noqa: E402
from switchyard.backends.cuda.kernels import TilePlan, dequant_gemm, dequant_gemm_reference  # noqa: E402
from switchyard.backends.cuda.marlin import MarlinApi, MarlinLinear  # noqa: E402
from switchyard.backends.cuda.packed_codes import dequantize_packed, unpack_codes  # noqa: E402

TARGET = quant.KernelTarget(DEVICE, torch.float32)
N = 40  # output columns: not a multiple of any BLOCK_N
M_ROWS = (1, 3, 17)  # a decode row, a few, past one BLOCK_M of 16
# Of the largest reference output. float32: summation order only. bf16 / fp16: the weight and the
# activations rounded to them once each before the float32-accumulated dot.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def block_weight(fmt: str, rows: int = N, seed: int = 0, blocks: int | None = None) -> QuantizedWeight:
    """A random weight: 3 blocks of 32 (K = 96: ragged against BLOCK_K 64) or 2 super-blocks of 256."""
    return random_blocks(fmt, rows, blocks or (2 if fmt.endswith("_k") else 3), seed=seed)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max()).item()


def inputs(rows: int, k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def module_for(weight, target=TARGET, bias=None):
    module, choice = quant.kernel_module(weight, bias, target)
    return module, choice


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, "int8"])
def test_packing_round_trips_every_format_exactly(fmt):
    weight = quantize_int8(torch.randn(N, 96)) if fmt == "int8" else block_weight(fmt)
    (packed,) = quant.pack_weight(weight, DEVICE)
    assert packed.shape == weight.shape
    assert torch.equal(dequantize_packed(packed).cpu(), weight.dequantize())
    exact_in_fp16 = fmt in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # d and m are fp16 fields
    assert packed.scales.dtype == (torch.float16 if exact_in_fp16 else torch.float32)
    k = weight.shape[1]
    if packed.bits == 4:
        assert packed.codes.dtype == torch.int32 and packed.codes.shape == (k // 8, N)
    else:
        assert packed.codes.element_size() == 1 and packed.codes.shape == (k, N)
    codes = unpack_codes(packed)
    assert (codes.dtype == torch.int8) == (fmt == "int8")  # int8 keeps its signed codes: w = d * q, exact
    assert int(codes.max()) < 2 ** packed.bits


@pytest.mark.parametrize("group,expected", [(128, 128), (-1, 256), (64, 64)])
def test_gptq_groups_come_back_from_the_32_weight_blocks(group, expected):
    """core converts GPTQ groups into q4_0 blocks of 32 repeating each scale; the pack merges them
    back (Marlin's groups of 128 and per channel, and fewer scales read)."""
    out, inp = 64, 256
    groups = 1 if group == -1 else inp // group
    u = torch.randint(0, 16, (out, inp))
    scale = torch.rand(out, groups) * 0.01 + 0.001
    weight = to_quantized(u, scale, torch.full((out, groups), 8), 4, "a layer")
    assert weight.format == "q4_0"
    (packed,) = quant.pack_weight(weight, DEVICE)
    assert packed.group == expected and packed.scales.shape == (inp // expected, out)
    assert torch.equal(dequantize_packed(packed).cpu(), weight.dequantize())


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, "int8"])
def test_kernel_matches_the_dequantized_reference_on_ragged_rows(fmt):
    weight = quantize_int8(torch.randn(N, 96)) if fmt == "int8" else block_weight(fmt, seed=1)
    module, choice = module_for(weight)
    assert isinstance(module, quant.TritonQuantLinear) and choice.kind == "triton"
    reference = weight.dequantize()
    for rows in M_ROWS:
        x = inputs(rows, weight.shape[1], seed=rows)
        out = module(x)
        assert out.shape == (rows, N) and out.dtype == x.dtype
        assert relative_error(out, x.cpu() @ reference.T) <= TOLERANCE[torch.float32], (fmt, rows)


PLANS = [  # forced tiles: ragged K slices (gathered scales), a BLOCK_N that cuts N, split K
    ("q4_0", TilePlan(16, 32, 64)), ("q8_0", TilePlan(16, 16, 64, split_k=2)), ("q4_1", TilePlan(32, 64, 128)),
    ("q4_k", TilePlan(16, 32, 128, split_k=3)), ("q6_k", TilePlan(16, 64, 64, split_k=2)),
    ("q5_k", TilePlan(32, 32, 512))]


@pytest.mark.parametrize("fmt,plan", PLANS)
def test_forced_tiles_split_k_and_ragged_slices(fmt, plan):
    weight = block_weight(fmt, seed=2, blocks=3)  # K = 96 or 768: ragged against most slices
    (packed,) = quant.pack_weight(weight, DEVICE)
    x = inputs(17, weight.shape[1], seed=3)
    out = dequant_gemm(x, packed, plan)
    assert relative_error(out, x.cpu() @ weight.dequantize().T) <= TOLERANCE[torch.float32]
    assert relative_error(dequant_gemm_reference(x, packed), x.cpu() @ weight.dequantize().T) <= 1e-6


@pytest.mark.parametrize("fmt,dtype", [("q4_0", torch.bfloat16), ("q4_k", torch.bfloat16), ("q6_k", torch.float16),
                                       ("q8_0", torch.float16)])
def test_half_precision_activations(fmt, dtype):
    weight = block_weight(fmt, seed=4)
    module, _ = module_for(weight, replace(TARGET, dtype=dtype))
    for rows in (1, 17):
        x = inputs(rows, weight.shape[1], dtype, seed=rows)
        out = module(x)
        assert out.dtype == dtype
        assert relative_error(out, x.float().cpu() @ weight.dequantize().T) <= TOLERANCE[dtype], rows


def test_fused_parts_in_different_formats():
    """Q4_K_M's q/k/v: q and k in Q4_K (one GEMM), v in Q6_K (another), outputs side by side."""
    q, k, v = block_weight("q4_k", 24, 5), block_weight("q4_k", 8, 6), block_weight("q6_k", 8, 7)
    parts = QuantizedParts((q, k, v))
    packs = quant.pack_weight(parts, DEVICE)
    assert [(p.bits, p.shape[0]) for p in packs] == [(4, 32), (6, 8)]
    module, choice = module_for(parts, bias=torch.randn(40))
    assert choice.kind == "triton" and module.out_features == 40
    for rows in M_ROWS:
        x = inputs(rows, 512, seed=rows)
        expected = x.cpu() @ parts.dequantize().T + module.bias.cpu()
        assert relative_error(module(x), expected) <= TOLERANCE[torch.float32]


def test_act_order_permutes_the_input_columns():
    """GPTQ desc_act: core sorts W's columns by group and keeps the order; the module puts x's
    columns in it, so the result is x @ W^T in the checkpoint's own column order."""
    out, inp, group = 40, 128, 32
    generator = torch.Generator().manual_seed(8)
    u = torch.randint(0, 16, (out, inp), generator=generator)
    order = torch.randperm(inp, generator=generator)
    scale = torch.rand(out, inp // group, generator=generator) * 0.01 + 0.001
    zero = torch.randint(0, 16, (out, inp // group), generator=generator)
    weight = to_quantized(u, scale, zero, 4, "a layer", order)
    assert weight.format == "q4_1" and weight.input_order is not None
    from switchyard.core.layers.linear import float_weight

    checkpoint_order = float_weight(weight, torch.float32)  # W in the checkpoint's column order
    module, _ = module_for(weight)
    assert module.input_order is not None
    for rows in M_ROWS:
        x = inputs(rows, inp, seed=rows)
        assert relative_error(module(x), x.cpu() @ checkpoint_order.T) <= TOLERANCE[torch.float32]


def fake_marlin(calls: list) -> MarlinApi:
    """Marlin's five functions as plain torch over the GPTQ layout they are handed (repack keeps it,
    apply dequantizes it: w = s * (u - 8)), recording what they are given."""

    def repack(qweight, perm, size_k, size_n, num_bits):
        calls.append(("repack", tuple(qweight.shape), qweight.dtype, perm.numel(), size_k, size_n, num_bits))
        return qweight.clone()

    def permute_scales(s, size_k, size_n, group_size):
        calls.append(("permute_scales", tuple(s.shape), s.dtype, group_size))
        return s.clone()

    def apply(*, input, weight, weight_scale, g_idx, is_k_full, output_size_per_partition, input_size_per_partition,
              **rest):
        k, n = input_size_per_partition, output_size_per_partition
        shifts = torch.arange(8, dtype=torch.int32) * 4
        u = ((weight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k, n)
        w = (u.float() - 8) * weight_scale.float().repeat_interleave(k // weight_scale.shape[0], dim=0)
        calls.append(("apply", g_idx.numel(), is_k_full, rest["wtype"]))
        return (input.float() @ w).to(input.dtype)

    empty = lambda device: torch.empty(0, dtype=torch.int32, device=device)  # noqa: E731
    return MarlinApi("fake", repack, permute_scales, empty, empty, apply, "uint4b8")


def gptq_weight(out: int, inp: int, group: int, sym: bool = True, seed: int = 9) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else inp // group
    scale = torch.rand(out, groups, generator=generator) * 0.01 + 0.001
    zero = torch.full((out, groups), 8) if sym else torch.randint(0, 16, (out, groups), generator=generator)
    return to_quantized(torch.randint(0, 16, (out, inp), generator=generator), scale, zero, 4, "a layer")


def test_marlin_takes_symmetric_4bit_groups_of_128_on_sm80_with_half_activations():
    calls: list = []
    target = quant.KernelTarget(DEVICE, torch.bfloat16, (9, 0), fake_marlin(calls))
    weight = gptq_weight(64, 256, 128)
    module, choice = module_for(weight, target)
    assert choice.kind == "marlin" and isinstance(module, MarlinLinear), choice
    assert calls[0] == ("repack", (32, 64), torch.int32, 0, 256, 64, 4)
    assert calls[1] == ("permute_scales", (2, 64), torch.bfloat16, 128)
    x = inputs(3, 256, torch.bfloat16)
    assert relative_error(module(x), x.float().cpu() @ weight.dequantize().T) <= TOLERANCE[torch.bfloat16]
    assert calls[-1] == ("apply", 0, True, "uint4b8")  # no g_idx: act-order is applied to x first
    per_channel, _ = module_for(gptq_weight(64, 256, -1), target)
    assert isinstance(per_channel, MarlinLinear) and calls[-1] == ("permute_scales", (1, 64), torch.bfloat16, -1)


@pytest.mark.skipif(not ON_GPU or quant.find_marlin() is None,
                    reason="needs an NVIDIA GPU (sm80+) and a package that ships Marlin (vLLM or gptqmodel)")
def test_the_installed_marlin_matches_the_reference():
    target = quant.KernelTarget.of(DEVICE, torch.float16)
    weight = gptq_weight(256, 512, 128)
    module, choice = module_for(weight, target)
    assert choice.kind == "marlin", choice.reason
    for rows in M_ROWS:
        x = inputs(rows, 512, torch.float16, seed=rows)
        assert relative_error(module(x), x.float().cpu() @ weight.dequantize().T) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("change,why", [
    (dict(marlin=None), "no Marlin package"), (dict(capability=(7, 5)), "compute capability 8.0"),
    (dict(capability=None), "compute capability 8.0"), (dict(dtype=torch.float32), "activations in float32"),
    (dict(weight=gptq_weight(64, 256, 32)), "groups of 32"),
    (dict(weight=gptq_weight(40, 256, 128)), "shape (40, 256)"),
    (dict(weight=gptq_weight(64, 256, 128, sym=False)), None)])
def test_what_marlin_refuses_goes_to_triton_with_the_reason(change, why):
    change = dict(change)
    weight = change.pop("weight", gptq_weight(64, 256, 128))
    target = replace(quant.KernelTarget(DEVICE, torch.bfloat16, (8, 0), fake_marlin([])), **change)
    choice = quant.choose_kernel(weight, target, quant.pack_weight(weight, DEVICE))
    assert choice.kind == "triton"
    assert (why in choice.reason) if why else "Marlin" not in choice.reason, choice.reason


def test_fp8_weights_take_the_fp8_module():
    from switchyard.backends.cuda.fp8_linear import CudaFp8Linear
    from switchyard.core.quant.weight import quantize_fp8

    weight = quantize_fp8(torch.randn(48, 64))
    module, choice = module_for(weight, bias=torch.randn(48))
    assert isinstance(module, CudaFp8Linear) and choice.kind == "fp8"
    if not ON_GPU:
        assert not module.tensorwise and "no fp8 tensor cores" in module.kernel
    x = inputs(5, 64)
    expected = x.cpu() @ weight.dequantize().T + module.bias.cpu()
    assert relative_error(module(x), expected) <= (5e-2 if module.tensorwise else 1e-6)


@pytest.mark.parametrize("fmt", ["bnb_nf4", "bnb_fp4", "bnb_int8"])
def test_bitsandbytes_weights_take_bitsandbytes_ops(fmt):
    pytest.importorskip("bitsandbytes")
    from switchyard.core.quant.weight import quantize_bnb

    weight = quantize_bnb(torch.randn(48, 128), fmt)
    module, choice = module_for(weight)
    assert choice.kind == "bitsandbytes" and type(module).graph_safe == (fmt != "bnb_int8")
    x = inputs(3, 128)
    # 4-bit: bitsandbytes dequantizes exactly; LLM.int8 rounds the activations to int8 per row
    assert relative_error(module(x), x.cpu() @ weight.dequantize().T) <= (1e-6 if fmt != "bnb_int8" else 2e-2)
    model = torch.nn.Sequential(module)
    assert graph_unsafe_kernels(model) == ([] if fmt != "bnb_int8" else ["CudaBnbInt8Linear"])


def test_capabilities_declare_what_each_gpu_backend_runs():
    from switchyard.backends.cuda import CudaBackend
    from switchyard.backends.rocm import RocmBackend
    from switchyard.core.capabilities import check_capabilities
    from switchyard.core.config import EngineConfig, ModelConfig
    from switchyard.core.errors import BackendCapabilityError
    from switchyard.core.quant.choice import served_method

    cuda, rocm = CudaBackend().capabilities().quantizations, RocmBackend().capabilities().quantizations
    assert set(cuda) == {"gguf", "int8", "int4", "gptq", "awq", "marlin", "compressed-tensors", "eetq",
                         "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8"}
    assert set(rocm) == {"gguf", "int8", "int4", "gptq", "awq", "compressed-tensors", "eetq"}  # its Triton GEMM
    # a GGUF file is served in its own blocks there too, as on the CPU (the Triton GEMM multiplies them)
    assert served_method(None, "model.gguf", None, backend_methods=cuda)[0] == "gguf"
    assert served_method(None, "model.gguf", None, backend_methods=rocm)[0] == "gguf"
    caps = RocmBackend().capabilities()
    refused = r"^backend 'rocm' does not support --quantize fp8; it supports: gguf"
    with pytest.raises(BackendCapabilityError, match=refused):
        check_capabilities("rocm", caps, EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy",
                                                                         quantize="fp8")))


def _engines():
    """Two engines of one tiny Llama quantized at load (--quantize int4) on the CUDA backend's logic
    over the CPU (cuda_fakes): one packs its linears for the Triton GEMM, one keeps core's path."""
    from cuda_fakes import CpuCudaBackend, FakeDevice

    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.quant.methods import served_by

    class Packing(CpuCudaBackend):
        def capabilities(self):
            return replace(super().capabilities(), quantizations=served_by("cuda"))

    class CorePath(Packing):
        def prepare_model(self, loaded, config) -> None:  # the quantized Linears dequantize in their forward
            pass

    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", seed=3, max_model_len=64,
                                            quantize="int4"),
                          cache=CacheConfig(block_size=4, num_blocks=48),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    packed = Packing(FakeDevice(), cuda_graphs=False)
    return EngineCore(config, backend=packed), EngineCore(config, backend=CorePath(FakeDevice(), cuda_graphs=False))


def test_a_tiny_llama_quantized_at_load_is_swapped_and_greedy_equal_to_the_dequantized_model():
    from cuda_fakes import generate

    packed, core = _engines()
    kinds = {type(m).__name__ for m in packed.loaded.model.modules() if isinstance(m, quant.CudaQuantLinear)}
    assert kinds == {"TritonQuantLinear"} and packed.backend.quantized == {"triton": 9}  # 2 x 4 linears + head
    head = packed.loaded.model.lm_head
    assert head.format == "int8" and head.layouts == [(8, 64)]  # int4's head is int8, one group per row
    prompts = [[5, 9, 13, 17, 21, 25, 29], [7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    assert generate(packed, prompts, 5) == generate(core, prompts, 5)


def test_importing_the_cuda_backend_does_not_import_triton():
    code = "import sys, switchyard.backends.cuda.backend; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(RUNS_HERE, reason="the kernels run in this process")
def test_in_a_fresh_process_if_triton_was_imported_too_early():
    rerun_in_fresh_process(__file__)
