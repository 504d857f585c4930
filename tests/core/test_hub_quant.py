"""Pre-quantized Hub checkpoints (GPTQ, AWQ, compressed-tensors) served on the CPU: each format,
built offline (hub_checkpoints.py), loaded without --quantize (detected from its
quantization_config), repacked into block formats and run by the CPU backend's kernels, against an
independent dequantized reference: logits of a chunked ragged batch within a tolerance, and 16
greedy tokens equal. Then the refusals, one line each."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from hub_checkpoints import build_compressed, build_packed
from parity_helpers import BLOCK_SIZE, greedy_ours, greedy_transformers, load_ours, one_thread, prompts  # noqa: F401
from model_helpers import run_two_steps

from switchyard.backends.cpu import CpuBackend
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from switchyard.core.errors import BackendCapabilityError
from switchyard.core.layers import Linear, MergedLinear
from switchyard.core.loader import load_model
from switchyard.core.quant import QuantizedWeight, quantize_int4
from switchyard.core.quant.apply import QuantizeError
from switchyard.core.quant.choice import served_method

# Of the largest logit of a request. The conversion itself (the core path: Linear's forward,
# dequantize + F.linear) is exact for symmetric formats (float32 summation order only), and
# rounds the asymmetric ones' m = -scale * zero to fp16 (measured: up to 0.3% of the largest
# logit; exact for the test packers' checkpoints, whose scales keep m exact: hub_checkpoints.py).
# The CPU kernels round activations besides (to int8 per 32 values in the block kernel, bf16 in
# the batch path; backends/cpu/quant.py): ~0.5% of the largest output per linear,
# compounded over these two layers of large random weights to up to 7.1% of the largest logit.
CORE_TOL = {"exact": 1e-5, "m rounded": 1e-2}
KERNEL_TOL = 0.1
GREEDY_TOKENS = 16


def serve(path, quantize=None, num_shard=1):
    """The model as an engine serves it on the CPU: capabilities checked (the served method
    decided there), loaded, prepare_model run. Returns (loaded, served method)."""
    backend = CpuBackend()
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32", quantize=quantize),
                          cache=CacheConfig(num_blocks=16), parallel=ParallelConfig(tensor_parallel_size=num_shard))
    config = check_capabilities("cpu", backend.capabilities(), config)
    loaded = load_model(config.model, backend, BLOCK_SIZE)
    backend.prepare_model(loaded, config)
    return loaded, config.model.quantize


def kernels(loaded) -> dict[str, str]:
    """Decoder linear name -> the module class that runs it."""
    return {name: type(module).__name__ for name, module in loaded.model.named_modules()
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


def assert_logits_within(loaded, reference, tol: float) -> None:
    """Logits of a chunked ragged batch (B's prompt in two chunks, A decoding beside B's second)."""
    ours = run_two_steps(loaded, prompts(loaded.vocab_size), 11, BLOCK_SIZE)
    for key, ids in prompts(loaded.vocab_size).items():
        ids = ids + [11] if key == "A" else ids
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].float()
        error = (ours[key] - expected).abs().max().item()
        assert error <= tol * expected.abs().max().item(), f"request {key}: {error}"


def assert_matches_reference(served, reference, path, exact: bool = False) -> None:
    """`served` (the CPU backend's kernels) within KERNEL_TOL of the reference; the same checkpoint
    on the core path (the reference backend: the converted weights dequantized in Linear's
    forward) within CORE_TOL (exact: a symmetric format, or m exact), and its greedy tokens equal
    to the reference's. (The kernels' greedy tokens are not compared: these random models' top
    two logits are often closer than the kernels' rounding, 0.003-0.07 apart at the closest of
    16 steps, where the kernels' logits are off by up to 0.4.)"""
    assert_logits_within(served, reference, KERNEL_TOL)
    core = load_ours(path)
    assert_logits_within(core, reference, CORE_TOL["exact" if exact else "m rounded"])
    prompt_lists = list(prompts(core.vocab_size).values())
    for prompt, tokens in zip(prompt_lists, greedy_ours(core, prompt_lists, GREEDY_TOKENS)):
        assert tokens == greedy_transformers(reference, prompt, GREEDY_TOKENS), prompt


GPTQ_CASES = [  # bits, group, act_order, sym, v1 (checkpoint_format gptq; else gptq_v2)
    (4, 32, True, False, True), (4, 128, False, True, True), (4, 64, True, True, False),
    (4, 128, True, False, True), (4, -1, False, False, True), (8, 32, False, True, True),
    (8, 32, True, True, True), (8, -1, False, True, False)]


@pytest.mark.parametrize("bits,group,act_order,sym,v1", GPTQ_CASES)
def test_gptq_checkpoint_matches_its_dequantized_reference(tmp_path, one_thread, bits, group, act_order, sym, v1):
    reference = build_packed(tmp_path, "gptq", bits=bits, group=group, act_order=act_order, sym=sym, v1=v1)
    loaded, method = serve(tmp_path)
    assert method == "gptq"
    expected = "Int8Linear" if bits == 8 and group == -1 else "BlockLinear"
    assert set(kernels(loaded).values()) == {expected}
    orders = [m.input_order is not None for m in loaded.model.modules() if hasattr(m, "input_order")]
    assert any(orders) == (act_order and group != -1)
    assert_matches_reference(loaded, reference, tmp_path, exact=True)  # m exact: see CORE_TOL


@pytest.mark.parametrize("group", [32, 128])
def test_awq_gemm_checkpoint_matches_its_dequantized_reference(tmp_path, one_thread, group):
    reference = build_packed(tmp_path, "awq", group=group)
    loaded, method = serve(tmp_path)
    assert method == "awq" and set(kernels(loaded).values()) == {"BlockLinear"}
    assert_matches_reference(loaded, reference, tmp_path, exact=True)


CT_CASES = [  # num_bits, strategy, group, symmetric: W4A16, W4A16_ASYM (group 32), W8A16, 8-bit per channel
    (4, "group", 128, True), (4, "group", 32, False), (8, "group", 128, True), (8, "channel", None, True),
    (4, "channel", None, False)]


@pytest.mark.parametrize("num_bits,strategy,group,symmetric", CT_CASES)
def test_compressed_tensors_checkpoint_matches_its_own_decompression(tmp_path, one_thread, num_bits, strategy,
                                                                      group, symmetric):
    pytest.importorskip("compressed_tensors")
    reference = build_compressed(tmp_path, num_bits, strategy, group, symmetric)
    loaded, method = serve(tmp_path)
    assert method == "compressed-tensors"
    # 8 bits: per channel "int8" (Int8Linear), in groups q8_0 (BlockLinear); a group of 128 is a
    # whole row of the 128-wide linears
    expected = {"Int8Linear"} if num_bits == 8 and strategy == "channel" else \
        {"Int8Linear", "BlockLinear"} if num_bits == 8 else {"BlockLinear"}
    assert set(kernels(loaded).values()) == expected
    assert_matches_reference(loaded, reference, tmp_path, exact=symmetric)


@pytest.mark.parametrize("desc_act,sym,group", [(True, False, 32), (False, True, 128), (True, True, 128),
                                                (False, False, 32)])
def test_gptqmodel_checkpoint_matches_gptqmodel(tmp_path, one_thread, desc_act, sym, group):
    """The real tool: a tiny Llama quantized by gptqmodel (on the CPU), against the same checkpoint
    dequantized by gptqmodel's own TorchLinear. gptqmodel needs torch >= 2.14.1 (pip would replace
    the pinned CPU torch), so it is not a test dependency: this runs where it is installed beside."""
    gptqmodel = pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (it requires torch>=2.14.1)")
    from hub_checkpoints import reference_model, tiny_config
    from model_helpers import make_hf

    hf = make_hf(tiny_config(), seed=5)
    hf.save_pretrained(tmp_path / "float")
    _save_tokenizer(tmp_path / "float")
    config = gptqmodel.QuantizeConfig(bits=4, group_size=group, desc_act=desc_act, sym=sym)
    model = gptqmodel.GPTQModel.load(str(tmp_path / "float"), config, device="cpu")
    generator = torch.Generator().manual_seed(1)
    model.quantize([{"input_ids": torch.randint(0, 256, (1, 64), generator=generator),
                     "attention_mask": torch.ones(1, 64, dtype=torch.long)} for _ in range(16)])
    model.save(str(tmp_path / "gptq"))
    theirs = gptqmodel.GPTQModel.load(str(tmp_path / "gptq"), device="cpu", backend=gptqmodel.BACKEND.TORCH,
                                      dtype=torch.float16)  # its CPU kernel takes fp16 or bf16; fp16 keeps the scales
    theirs.model.float()  # dequantized in float32
    weights = {name: module.dequantize_weight().float().T for name, module in theirs.model.named_modules()
               if hasattr(module, "dequantize_weight")}  # it returns [in, out]
    reference = reference_model(hf, weights)
    # gptqmodel saves the float tensors (embeddings, norms, head) in bf16: the reference takes them so
    floats = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in floats:
                param.copy_(floats[name].float())
    loaded, method = serve(tmp_path / "gptq")
    assert method == "gptq"
    assert set(kernels(loaded).values()) == {"BlockLinear"}  # q/k/v (gate/up) share one act-order: joined
    assert_matches_reference(loaded, reference, tmp_path / "gptq", exact=sym)


@pytest.mark.parametrize("scheme,algorithm", [("W4A16", "rtn"), ("W4A16_ASYM", "rtn"), ("W8A16", "rtn"),
                                              ("W4A16", "gptq"), ("W4A16_ASYM", "gptq")])
def test_llmcompressor_checkpoint_matches_transformers(tmp_path, one_thread, scheme, algorithm):
    """The real tool: a tiny bf16 Llama quantized by llm-compressor (RTN, or GPTQ with act-order
    "weight"), against the same checkpoint as transformers loads it (decompressed by
    compressed-tensors). llm-compressor pins transformers<=5.17 and compressed-tensors 0.19, so it
    is not a test dependency: this runs where it is installed beside."""
    llmcompressor = pytest.importorskip("llmcompressor", reason="llmcompressor is not installed (it pins "
                                        "transformers<=5.17)")
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from hub_checkpoints import tiny_config
    from model_helpers import make_hf
    from transformers import AutoModelForCausalLM

    make_hf(tiny_config(), seed=6).to(torch.bfloat16).save_pretrained(tmp_path / "float")
    _save_tokenizer(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16)
    if algorithm == "rtn":
        llmcompressor.oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
                                                                       ignore=["lm_head"]))
    else:
        from datasets import Dataset

        generator = torch.Generator().manual_seed(1)
        data = Dataset.from_dict({"input_ids": [torch.randint(0, 256, (64,), generator=generator).tolist()
                                                for _ in range(16)], "attention_mask": [[1] * 64] * 16})
        llmcompressor.oneshot(model=model, dataset=data, num_calibration_samples=16, max_seq_length=64,
                              recipe=GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                                  actorder="weight"))
    model.save_pretrained(tmp_path / "ct", save_compressed=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    loaded, method = serve(tmp_path / "ct")
    assert method == "compressed-tensors"
    assert_matches_reference(loaded, reference, tmp_path / "ct", exact="ASYM" not in scheme)


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)


def test_sharded_checkpoint_without_g_idx(tmp_path, one_thread):
    """A layer's tensors split over two safetensors files (an index.json), and no g_idx (older
    AutoGPTQ checkpoints without act-order): column // group."""
    from safetensors.torch import save_file

    reference = build_packed(tmp_path, "gptq", bits=4, group=64, act_order=False, sym=False, v1=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    names = sorted(name for name in tensors if not name.endswith(".g_idx"))
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, str(tmp_path / file), metadata={"format": "pt"})
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {name: file for file, part in halves.items() for name in part}}, f)
    loaded, method = serve(tmp_path)
    assert method == "gptq" and set(kernels(loaded).values()) == {"BlockLinear"}
    assert_matches_reference(loaded, reference, tmp_path, exact=True)


def test_quantize_flag_is_checked_against_the_checkpoint(tmp_path, one_thread):
    build_packed(tmp_path, "gptq", bits=4, group=32, act_order=False, sym=True, v1=True)
    assert serve(tmp_path, quantize="gptq")[1] == "gptq"
    assert serve(tmp_path, quantize="marlin")[1] == "gptq"  # TGI's name for GPTQ on its Marlin kernel
    with pytest.raises(QuantizeError, match="--quantize awq: the checkpoint is quantized with gptq"):
        serve(tmp_path, quantize="awq")
    with pytest.raises(BackendCapabilityError, match="cannot be combined with --num-shard 2"):
        serve(tmp_path, num_shard=2)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
CT_W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}


def _ct(weights=None, **scheme):
    group = {**CT_W4["config_groups"]["group_0"], **scheme}
    group["weights"] = {**group["weights"], **(weights or {})}
    return {**CT_W4, "config_groups": {"group_0": group}}


@pytest.mark.parametrize("config, words", [
    ({**GPTQ, "bits": 3},
     "checkpoint quantization not supported: GPTQ, 3-bit weights; the CPU serves 4-bit weights in groups of 32"),
    ({**GPTQ, "bits": 2}, "GPTQ, 2-bit weights; the CPU serves"),
    ({**GPTQ, "group_size": 48}, "GPTQ, group size 48;"),
    ({**GPTQ, "bits": 8, "sym": False}, "GPTQ, asymmetric 8-bit weights;"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' (repacked for a GPU kernel"),
    ({**GPTQ, "is_marlin_format": True}, "a Marlin-format checkpoint (repacked for the Marlin GPU kernel"),
    ({"quant_method": "marlin", "group_size": 128}, "a Marlin-format checkpoint"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, "GPTQ with per-module overrides (dynamic)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": False},
     "AWQ without zero points"),
    (_ct(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "quantized activations (W8A8, W4A8; the CPU serves weight-only W4A16, W8A16)"),
    (_ct({"type": "float", "num_bits": 4}), "float weights (NVFP4, MXFP4; FP8 is the fp8 method's)"),
    (_ct({"num_bits": 8, "symmetric": False}), "asymmetric 8-bit weights"),
    (_ct({"group_size": 16}), "group size 16"),
    (_ct({"strategy": "block"}), "strategy 'block'"),
    ({**CT_W4, "format": "marlin-24"}, "format 'marlin-24'"),
    ({**CT_W4, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "a quantized KV cache"),
    ({"quant_method": "hqq"}, "checkpoint quantization 'hqq' is not supported; supported checkpoint quantizations:"),
])
def test_unsupported_checkpoints_are_refused_in_one_line(config, words):
    with pytest.raises(QuantizeError, match=None) as error:
        served_method(None, None, config)
    message = str(error.value)
    assert words in message and "\n" not in message


def test_checkpoint_methods_need_a_quantized_checkpoint():
    for method in ("gptq", "awq", "compressed-tensors", "marlin"):
        with pytest.raises(QuantizeError, match=f"--quantize {method} needs a checkpoint quantized with {method}"):
            served_method(method, None, None)
    with pytest.raises(QuantizeError, match="--quantize gptq needs a checkpoint quantized"):
        served_method("gptq", "model.gguf", None)
    assert served_method("marlin", None, {"quant_method": "awq", "bits": 4, "group_size": 128})[0] == "awq"
    with pytest.raises(QuantizeError, match="--quantize none: the checkpoint is quantized with gptq"):
        served_method("none", None, GPTQ)


def test_eetq_is_served_as_int8_made_at_load():
    backend = CpuBackend()
    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", quantize="eetq"),
                          cache=CacheConfig(num_blocks=8))
    config = check_capabilities("cpu", backend.capabilities(), config)
    assert config.model.quantize == "int8"
    loaded = load_model(config.model, backend, 16)
    backend.prepare_model(loaded, config)
    assert {type(m).__name__ for m in loaded.model.modules()} >= {"Int8Linear"}


def _act_order(weight: QuantizedWeight, seed: int) -> QuantizedWeight:
    order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(weight.format, weight.shape, weight.data, weight.scales, order)


def test_linear_reference_honours_input_order():
    weight = _act_order(quantize_int4(torch.randn(8, 64)), 0)
    layer = Linear(64, 8)
    layer.load("weight", weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x[:, weight.input_order] @ weight.dequantize().T)


def test_merged_parts_join_with_one_input_order_or_are_dequantized(caplog):
    base = [quantize_int4(torch.randn(n, 64)) for n in (16, 8)]
    same = [_act_order(w, 0) for w in base]
    joined = MergedLinear(64, [16, 8])
    for shard, part in enumerate(same):
        joined.load_shard(joined.weight, shard, part)
    assert torch.equal(joined.quantized.input_order, same[0].input_order)
    x = torch.randn(2, 64)
    expected = torch.cat([x[:, p.input_order] @ p.dequantize().T for p in same], dim=1)
    torch.testing.assert_close(joined(x), expected)
    differing = [_act_order(w, i) for i, w in enumerate(base)]
    merged = MergedLinear(64, [16, 8])
    with caplog.at_level(logging.INFO):
        for shard, part in enumerate(differing):
            merged.load_shard(merged.weight, shard, part)
    assert merged.quantized is None and "differ in format or input order: dequantized" in caplog.text
    expected = torch.cat([x[:, p.input_order] @ p.dequantize().T for p in differing], dim=1)
    torch.testing.assert_close(merged(x), expected)


def test_act_order_weights_pass_their_input_order_to_the_fused_decode_path():
    from switchyard.backends.cpu.fused_decode import linear_operands
    from switchyard.backends.cpu.quant import Int4Linear

    weight = _act_order(quantize_int4(torch.randn(16, 64)), 0)
    tensors, _ = linear_operands(Int4Linear(weight, None, None), torch.float32)
    assert torch.equal(tensors[-1], weight.input_order)
    tensors, _ = linear_operands(Int4Linear(quantize_int4(torch.randn(16, 64)), None, None), torch.float32)
    assert tensors[-1].numel() == 0  # no order


def test_backends_command_prints_the_method_table(capsys):
    from switchyard.gateway.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for line in ("gptq (checkpoint; cpu, cuda, rocm)", "awq (checkpoint; cpu, cuda, rocm)",
                 "compressed-tensors (checkpoint; cpu, cuda, rocm)", "marlin (checkpoint; cpu, cuda)",
                 "eetq (at-load; cpu, cuda, rocm)"):
        assert out.count(line) == 1


def test_quantization_config_is_read_from_config_json(tmp_path):
    """What the loader reads: config.json's quantization_config, as written by the tools."""
    build_packed(tmp_path, "awq", group=32)
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "awq"
    assert served_method(None, None, json.load(open(tmp_path / "config.json"))["quantization_config"])[0] == "awq"


def test_act_order_checkpoint_takes_the_fused_decode_path(tmp_path):
    """An act-order GPTQ checkpoint's decode steps run every layer in C++ (each linear gathers its
    input columns in its weight's order first), with the logits of the eager layers."""
    from switchyard.backends.cpu.fused_decode import FusedDecodeRunner
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.execution.runner import ModelRunner
    from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput

    build_packed(tmp_path, "gptq", bits=4, group=32, act_order=True, sym=True, v1=True)

    def decode_logits(fused: bool) -> list[torch.Tensor]:
        config = EngineConfig(model=ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=64),
                              cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=32), compile_decode=fused)
        core = EngineCore(config, backend=CpuBackend())
        try:
            if fused:
                assert isinstance(core.runner, FusedDecodeRunner)
            prompt, blocks = list(range(3, 14)), tuple(range(1, 1 + 64 // BLOCK_SIZE))
            ModelRunner.execute(core.runner, SchedulerOutput((ScheduledRequest("a", tuple(prompt), 0, blocks, True),)))
            return [core.runner.execute(SchedulerOutput((ScheduledRequest("a", (20 + step,), len(prompt) + step,
                                                                          blocks, True),)))[0] for step in range(3)]
        finally:
            core.shutdown()

    for expected, got in zip(decode_logits(False), decode_logits(True), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=3e-4)  # the eager and C++ layers' rounding
