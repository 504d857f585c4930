"""float8 e4m3 weights on the CPU, weight-only (csrc/fp8_matmul.cpp; backends/cpu/fp8_linear.py).

Checkpoints: a tiny random Llama saved as floats, then quantized with compressed-tensors itself
(llm-compressor's library; llm-compressor proper would replace this machine's transformers): its
FP8_DYNAMIC (per channel), FP8_BLOCK (128x128) and FP8 (per tensor, static input scales) presets
applied by apply_quantization_config, the weight scales computed by its calculate_qparams from each
weight's min/max (what llm-compressor's min-max observer feeds it), compressed by ModelCompressor
("float-quantized") and saved with its config. The DeepSeek-V3 / Qwen3 layout (quant_method "fp8",
`weight_scale_inv` per 128x128 block) is written by plain torch here, as transformers'
FineGrainedFP8 quantizer computes it (scale = block max / 448, weight / scale cast to float8).

The independent reference is torch's own float8 conversion times the scales, in the float
transformers model. Compared: the kernel against torch on every byte value and shape, each
module, the served model on a chunked ragged batch and 16 greedy tokens of three requests
decoded together, --quantize fp8 of the float checkpoint, and the refusals.

Tolerances: the kernel sums in float32, and batches over 8 rows multiply the weight dequantized
into the activations' dtype: float32 rows within 1e-5 of the largest output (the model's logits
1e-4), bfloat16 rows within 1% (their own rounding).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from kernel_variants import build_variant
from scaled_helpers import (assert_close_logits, cpu_model, greedy_hf, greedy_ours, hf_logits, module_kinds,
                            save_float, tiny_llama, two_steps, with_weights)

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.fp8_linear import FP8_SOURCE, Fp8Linear, load_fp8_kernel
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import EngineConfig, ModelConfig
from switchyard.core.loader.gguf_cache import default_cache_root
from switchyard.core.quant.hub import weights_reader
from switchyard.core.quant.hub.fp8 import fp8_weight
from switchyard.core.quant.choice import served_method
from switchyard.core.quant.methods import QuantizeError, detect, served_by
from switchyard.core.quant.weight import quantize_fp8
from switchyard.core.quant.weight import QuantizedWeight

PRESETS = ("FP8_DYNAMIC", "FP8_BLOCK", "FP8")
MODEL_TOL = 1e-4  # of the largest logit, float32 model (measured < 5e-5)


@pytest.fixture(scope="module")
def fp8_ops():
    build = load_fp8_kernel(default_cache_root())
    if not build.available:
        pytest.skip(f"no fp8 kernel here: {build.reason}")
    return build.ops


def random_fp8(out: int, inp: int, groups: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_fp8(torch.randn(out, inp, generator=gen))
    scales = weight.scales * (0.5 + torch.rand(out, groups, generator=gen))
    return QuantizedWeight("fp8_e4m3", (out, inp), weight.data, scales.contiguous())


def test_every_byte_value_converts_as_torch_does(fp8_ops):
    data = torch.arange(256, dtype=torch.uint8).repeat(3, 1)
    scales = torch.tensor([[1.0], [0.5], [3.0]])
    expected = data.view(torch.float8_e4m3fn).float() * scales
    finite = ~expected.isnan()  # 0x7F / 0xFF are NaN in e4m3fn (never in weights): the kernel reads +-480
    for dtype in (torch.float32, torch.bfloat16):
        out = fp8_ops.fp8_dequantize(data, scales, dtype)
        assert torch.equal(out[finite], expected[finite].to(dtype))
    x = torch.eye(256)[:5]
    torch.testing.assert_close(fp8_ops.fp8_mm(x, data, scales, None)[:, :5][finite[:, :5].T],
                               expected.T[:5][finite[:, :5].T], rtol=0, atol=0)


@pytest.mark.parametrize("out,inp,groups", [(40, 256, 1), (37, 384, 3), (64, 128, 8), (9, 16, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dequantized_weight(out, inp, groups, rows, dtype, fp8_ops):
    """Every row-block size (4 rows at a time, then 1-3), a partial last tile of weight rows, groups
    of 16..384 columns, a bias."""
    weight = random_fp8(out, inp, groups, seed=rows)
    x = torch.randn(rows, inp).to(dtype)
    bias = torch.randn(out)
    got = fp8_ops.fp8_mm(x, weight.data, weight.scales, bias)
    expected = x.float() @ weight.dequantize().T + bias
    assert got.dtype == dtype and got.shape == (rows, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - expected).abs().max() <= tol * expected.abs().max()
    assert torch.equal(fp8_ops.fp8_dequantize(weight.data, weight.scales, torch.float32), weight.dequantize())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_other_instruction_sets_compute_the_same(variant, tmp_path):
    ops = build_variant(FP8_SOURCE, variant, tmp_path)
    assert ops.fp8_mm_isa() == variant
    weight = random_fp8(37, 384, 3)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 384)
        expected = x @ weight.dequantize().T
        got = ops.fp8_mm(x, weight.data, weight.scales, None)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(ops.fp8_dequantize(weight.data, weight.scales, torch.float32), weight.dequantize())


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,batch_rows", [(1, 16), (8, 16), (9, 16), (300, 16), (5, None)])
def test_module_matches_the_dequantized_weight(kernel, dtype, rows, batch_rows, fp8_ops):
    """The kernel for up to 8 rows, fp8_dequantize + a matmul in x's dtype for more; without the
    kernel the torch path (CHUNK_ROWS output rows dequantized at a time: 300 of them here)."""
    weight = random_fp8(300, 256, 2)
    bias = torch.randn(300).to(dtype)
    x = torch.randn(rows, 256).to(dtype)
    with torch.inference_mode():
        out = Fp8Linear(weight, fp8_ops if kernel else None, bias, batch_rows)(x)
    expected = x.float() @ weight.dequantize().T + bias.float()
    assert out.shape == (rows, 300) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - expected).abs().max() <= tol * expected.abs().max()


def test_groups_the_kernel_cannot_take_use_the_torch_path(fp8_ops):
    weight = random_fp8(8, 96, 12)  # groups of 8 columns
    module = Fp8Linear(weight, fp8_ops, None, 16)
    assert module.ops is None
    x = torch.randn(3, 96)
    torch.testing.assert_close(module(x), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_module_traces_under_torch_compile(fp8_ops):
    # Dynamo's recompile limit counts per code object, process-wide: the quantized linears' shared
    # forward (backends/cpu/quant.py) was compiled for other modules by earlier tests of the suite.
    torch._dynamo.reset()
    module = Fp8Linear(random_fp8(64, 128, 1), fp8_ops, None, 16)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        for rows in (2, 20):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(compiled(x), module(x))


def compressed_tensors_checkpoint(float_dir, preset: str, path) -> None:
    """The float checkpoint quantized with compressed-tensors' `preset` (see the module docstring)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    del ct
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.detach().float()
        if args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        else:  # block
            bn, bk = args.block_structure
            blocks = weight.reshape(weight.shape[0] // bn, bn, weight.shape[1] // bk, bk)
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, _ = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):  # static activation scales: unused by the weight-only CPU path
            module.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def deepseek_checkpoint(float_dir, path, block: int = 128) -> None:
    """quant_method "fp8" with weight_block_size [128, 128]: every linear but the head as float8
    `weight` and `weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (block max / 448)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(float_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, weight in tensors.items():
        if weight.dim() != 2 or "embed" in name or "lm_head" in name:
            out[name] = weight
            continue
        rows, cols = weight.shape
        padded = torch.nn.functional.pad(weight.float(), (0, -cols % block, 0, -rows % block))
        blocks = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
        scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-12)
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        out[name] = (weight.float() / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name.replace("weight", "weight_scale_inv")] = scale
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [block, block], "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    save_float(tiny_llama(hidden=256), root / "float")  # in = 256 / 512: 2 and 4 blocks of 128 a row
    made = {"float": root / "float"}
    for preset in PRESETS:
        compressed_tensors_checkpoint(root / "float", preset, root / preset)
        made[preset] = root / preset
    deepseek_checkpoint(root / "float", root / "deepseek")
    made["deepseek"] = root / "deepseek"
    return made


def dequantized_by_torch(path) -> dict[str, torch.Tensor]:
    """Each float8 weight of a checkpoint times its scale (per tensor / channel / block), by torch."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    block = config.get("weight_block_size") or [128, 128]
    out = {}
    for name, weight in tensors.items():
        if weight.dtype != torch.float8_e4m3fn:
            continue
        scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale")).float()
        rows, cols = weight.shape
        if scale.numel() > 1 and scale.shape[0] != rows:  # blocks
            scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
        out[name] = weight.float() * (scale if scale.numel() > 1 else scale.reshape(()))
    return out


@pytest.mark.parametrize("kind", [*PRESETS, "deepseek"])
def test_checkpoint_served_matches_the_dequantized_reference(kind, checkpoints):
    from transformers import AutoModelForCausalLM

    path = checkpoints[kind]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert detect(config).name == "fp8"
    expected = dequantized_by_torch(path)
    read = dict(weights_reader(config)([str(path / "model.safetensors")], config))
    for name, weight in expected.items():
        assert read[name].format == "fp8_e4m3" and torch.equal(read[name].dequantize(), weight), name
    loaded, served = cpu_model(path)
    assert served == "fp8" and "Fp8Linear" in module_kinds(loaded)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["float"], attn_implementation="eager",
                                              dtype=torch.float32).eval()
    reference = with_weights(hf, expected)
    assert_close_logits(two_steps(loaded), hf_logits(reference), MODEL_TOL)
    assert greedy_ours(loaded, 16) == greedy_hf(reference, 16)


def test_quantize_fp8_of_a_float_checkpoint(checkpoints):
    """--quantize fp8 (TGI's on-the-fly fp8): per-channel float8 for every linear, the head too."""
    from transformers import AutoModelForCausalLM

    loaded, served = cpu_model(checkpoints["float"], "fp8")
    assert served == "fp8"
    assert sum(isinstance(m, Fp8Linear) for m in loaded.model.modules()) == 2 * 4 + 1
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["float"], attn_implementation="eager",
                                              dtype=torch.float32).eval()
    weights = {}
    for name, param in hf.named_parameters():
        if param.dim() == 2 and "embed" not in name:
            scale = param.detach().abs().amax(1, keepdim=True) / 448
            weights[name] = (param.detach() / scale).to(torch.float8_e4m3fn).float() * scale
    reference = with_weights(hf, weights)
    assert_close_logits(two_steps(loaded), hf_logits(reference), MODEL_TOL)
    assert greedy_ours(loaded, 16) == greedy_hf(reference, 16)


def test_blocks_that_straddle_the_last_columns_are_read_as_floats():
    weight = torch.randn(130, 200).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2) + 0.5
    out = fp8_weight(weight, scale, (128, 128), "a layer")
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :200]
    assert isinstance(out, torch.Tensor) and torch.equal(out, weight.float() * expanded)
    aligned = fp8_weight(weight[:, :128], scale[:, :1], (128, 128), "a layer")
    assert aligned.format == "fp8_e4m3" and aligned.scales.shape == (130, 1)
    assert torch.equal(aligned.dequantize(), weight[:, :128].float() * expanded[:, :128])


def test_refusals(checkpoints):
    caps = CpuBackend().capabilities()
    assert "fp8" in served_by("cpu") and "fp8" in caps.quantizations
    block = str(checkpoints["FP8_BLOCK"])
    with pytest.raises(QuantizeError, match="the checkpoint is quantized with fp8"):
        check_capabilities("cpu", caps, EngineConfig(model=ModelConfig(model=block, quantize="bitsandbytes")))
    base = {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}
    with pytest.raises(QuantizeError, match="FP8 checkpoint: a quantized KV cache"):
        served_method(None, None, {**base, "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    with pytest.raises(QuantizeError, match="FP8 checkpoint: fmt 'e5m2' is not supported"):
        served_method(None, None, {"quant_method": "fp8", "fmt": "e5m2"})
    with pytest.raises(QuantizeError, match="weight strategy 'token'"):
        served_method(None, None, {**base, "config_groups": {"g": {"weights": {
            "type": "float", "num_bits": 8, "strategy": "token"}}}})
    assert math.isclose(448.0, float(torch.finfo(torch.float8_e4m3fn).max))


def test_the_cuda_module_imports_and_falls_back_without_fp8_tensor_cores():
    """backends/cuda/fp8_linear.py (torch._scaled_mm, compute capability >= 8.9) is not wired into
    the CUDA backend yet; without a GPU it multiplies the dequantized weight, as on an older GPU."""
    from switchyard.backends.cuda.fp8_linear import CudaFp8Linear, fp8_supported

    weight = random_fp8(32, 64, 1)
    module = CudaFp8Linear(weight, None, torch.device("cpu"))
    assert not module.tensorwise and (fp8_supported() or not torch.cuda.is_available())
    x = torch.randn(3, 64)
    torch.testing.assert_close(module(x), x @ weight.dequantize().T)
