"""Quantized checkpoints written by the real tools, served by Switchyard on the CPU.

gptqmodel (GPTQ, AWQ) and llm-compressor (compressed-tensors W4A16, W4A16_ASYM, W8A16, FP8_DYNAMIC)
quantize a tiny Llama (quant_tools_model.py), calibrating on a few short texts, and save it as a
Hub checkpoint. Switchyard serves that directory as it is (the method detected from config.json's
quantization_config) through its offline LLM class on the CPU backend, eager steps and the fused
C++ decode steps a server runs. Each is checked against the tool's own dequantized model run
under transformers in float32:

- logits: every position of a fixed prompt and of the 12 tokens generated after it, taken from
  the engine's log-probabilities of the whole vocabulary (prompt_logprobs and logprobs, so
  compared up to each row's log-sum-exp), within LOGIT_TOL of the row's largest logit;
- greedy tokens: 12 tokens of four prompts, one batch, equal to transformers' greedy tokens.

The tools pin torch and transformers of their own, so these run in their own venv,
`.ci/backend_env.sh quanttools`, and are skipped where the tools are not installed.
"""
from __future__ import annotations

import importlib.util
import os

# gptqmodel (7.3.6-7.7.0) sizes its CPU worker pool at (cores + 1) // 2 and its model-loader pool
# at 2 workers of that pool: on a 2-core machine the pool has 1 and GPTQModel.load fails
# ("Virtual pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1").
# GPTQMODEL_CPU_WORKERS overrides the first (gptqmodel/__init__.py); read when gptqmodel is imported.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import pytest  # noqa: E402
import torch  # noqa: E402
from quant_tools_model import PROMPTS, TEXTS, build_float_model, calibration_ids  # noqa: E402

from switchyard.core.llm import LLM  # noqa: E402
from switchyard.core.params import SamplingParams  # noqa: E402
from switchyard.core.quant.apply import QuantizeError  # noqa: E402
from switchyard.core.scheduling.request import Request  # noqa: E402

WHERE = "runs in `.ci/backend_env.sh quanttools` (the tools pin their own torch and transformers)"
needs_gptqmodel = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                                     reason=f"gptqmodel is not installed: {WHERE}")
needs_llmcompressor = pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None,
                                         reason=f"llmcompressor is not installed: {WHERE}")
# Of the row's largest logit (~17 here). Measured on this model (2-core AVX-512 VNNI machine, eager
# and fused steps alike): symmetric GPTQ, W4A16, W8A16 up to 2.4e-5; AWQ and W4A16_ASYM (zero
# points) up to 7.5e-5; asymmetric GPTQ in groups of 32 with act-order up to 3.6e-4 (the zero point
# becomes q4_1's offset -scale * zero, rounded to fp16); FP8 6e-7. The rest is the block kernels'
# int8x2 activations. A reader bug as small as the zero points of one group of 32 columns of one
# layer off by one gives 1.9e-2: 10x this.
LOGIT_TOL = 2e-3
GREEDY_TOKENS = 12
GREEDY_PROMPTS = PROMPTS
DECODER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a loaded 2-core machine they cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def tool_logs_in_tmp(tmp_path, monkeypatch):
    """gptqmodel writes its AWQ logs into the working directory: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> str:
    """The trained tiny Llama and its tokenizer, bf16 safetensors (built once, ~10 s)."""
    return build_float_model(str(tmp_path_factory.mktemp("float")))


# --- the references: the tool's own dequantized weights in a float32 transformers model ---

def reference_with(checkpoint: str, float_model: str, weights: dict[str, torch.Tensor]):
    """The float model in float32 with the checkpoint's float tensors (embeddings, norms, head: a
    tool may rescale norms, as AWQ does) and `weights` (module name -> float [out, in])."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(float_model, dtype=torch.float32).eval()
    floats = load_file(os.path.join(checkpoint, "model.safetensors"))
    modules = dict(reference.named_modules())
    with torch.no_grad():
        copied = 0
        for name, parameter in reference.named_parameters():
            if name in floats:
                parameter.copy_(floats[name].float())
                copied += 1
        assert copied == 7  # embeddings, 5 norms, head
        assert len(weights) == 14
        for name, weight in weights.items():
            modules[name].weight.copy_(weight)
    return reference


def gptqmodel_reference(checkpoint: str, float_model: str, method: str):
    """The checkpoint as gptqmodel reads it back (its torch kernels), dequantized by gptqmodel."""
    import gptqmodel

    backend = gptqmodel.BACKEND.AWQ_TORCH if method == "awq" else gptqmodel.BACKEND.TORCH
    theirs = gptqmodel.GPTQModel.load(checkpoint, device="cpu", backend=backend, dtype=torch.float16)
    weights = {}
    for name, module in theirs.model.named_modules():
        if method == "awq" and hasattr(module, "qzeros"):
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

            weights[name] = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits,
                                            module.group_size).float().T  # [in, out] -> [out, in]
        elif method == "gptq" and hasattr(module, "dequantize_weight"):
            module.float()  # scales in float32: the dequantized weight is not rounded to fp16
            weights[name] = module.dequantize_weight().float().T
    return reference_with(checkpoint, float_model, weights)


def compressed_reference(checkpoint: str):
    """The checkpoint as transformers loads it (compressed-tensors decompresses every weight), with
    the activations left in float: Switchyard serves weight-only (FP8_DYNAMIC's dynamic fp8
    activations are not applied, core/quant/hub/fp8.py; the integer schemes have none)."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    reference = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    reference.apply(disable_quantization)
    return reference


# --- what Switchyard serves, and the comparison ---

def greedy_reference(reference, ids: list[int], count: int) -> list[int]:
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(count):
            sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(ids):]


def served_logprobs(llm: LLM, ids: list[int], count: int, vocab: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, log-probabilities [len(ids) + count - 1, vocab]) from the engine: a row for
    each prompt token after the first (prompt_logprobs) and for each generated token (logprobs),
    each scored by the logits of the position before it."""
    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True, logprobs=vocab,
                            prompt_logprobs=vocab)
    request = Request(f"logprobs-{len(ids)}-{ids[-1]}", list(ids), params)
    llm.engine.add_request(request)
    tokens, rows = [], []

    def row(top) -> torch.Tensor:
        values = torch.full((vocab,), float("nan"))
        for token, logprob in top:
            values[token] = logprob
        return values

    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id == request.request_id and out.error is None
            if out.prompt_logprobs:
                rows += [row(top) for _, _, top in out.prompt_logprobs[1:]]
            rows += [row(top) for top in out.top_logprobs or ()]
            tokens += out.new_token_ids
    return tokens, torch.stack(rows)


def assert_serves_like(checkpoint: str, reference, method: str, kernel: str) -> None:
    """Serves `checkpoint` (eager steps, then the fused C++ decode steps) and checks the method
    detected, the kernels the decoder linears run on, greedy tokens and logits (module doc)."""
    vocab = reference.config.vocab_size
    for fused in (False, True):
        llm = LLM(model=checkpoint, backend="cpu", compile_decode=fused)
        try:
            assert llm.engine.config.model.quantize == method
            linears = {type(m).__name__ for name, m in llm.engine.runner.model.named_modules()
                       if name.endswith(DECODER_LINEARS)}
            assert linears == {kernel}, linears
            results = llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS,
                                                                  ignore_eos=True))
            for prompt, result in zip(GREEDY_PROMPTS, results, strict=True):
                ids = list(result.prompt_token_ids)
                assert ids == llm.tokenizer(prompt)["input_ids"] and ids[0] == llm.tokenizer.bos_token_id
                expected = greedy_reference(reference, ids, GREEDY_TOKENS)
                assert list(result.token_ids) == expected, (fused, prompt)
            ids = llm.tokenizer(GREEDY_PROMPTS[0])["input_ids"]
            tokens, ours = served_logprobs(llm, ids, GREEDY_TOKENS, vocab)
            assert tokens == greedy_reference(reference, ids, GREEDY_TOKENS)
            with torch.no_grad():
                logits = reference(torch.tensor([ids + tokens[:-1]])).logits[0].float()
            assert ours.shape == logits.shape and not ours.isnan().any()
            theirs = torch.log_softmax(logits, dim=-1)
            error = (ours - theirs).abs().amax(dim=-1)  # per position
            limit = LOGIT_TOL * logits.abs().amax(dim=-1)
            assert (error <= limit).all(), (fused, error.max().item(), (error / limit).max().item())
        finally:
            llm.shutdown()


def assert_refused_in_one_line(checkpoint: str, words: str) -> None:
    with pytest.raises(QuantizeError) as refused:
        LLM(model=checkpoint, backend="cpu")
    message = str(refused.value)
    assert words in message and "\n" not in message, message


# --- gptqmodel ---

def gptqmodel_quantize(float_model: str, path: str, **config) -> str:
    import gptqmodel

    method = config.get("quant_method", "gptq")
    model = gptqmodel.GPTQModel.load(float_model, gptqmodel.QuantizeConfig(bits=4, **config), device="cpu")
    # AWQ's default kernel for packing is its CUDA GEMM: the torch one on the CPU
    backend = gptqmodel.BACKEND.AWQ_TORCH if method == "awq" else gptqmodel.BACKEND.AUTO
    model.quantize(TEXTS, batch_size=1, backend=backend)
    model.save(path)
    return path


@needs_gptqmodel
@pytest.mark.parametrize("group,sym,desc_act", [(128, True, False), (32, False, True)])
def test_gptqmodel_gptq_checkpoint_serves_like_gptqmodel(float_model, tmp_path, group, sym, desc_act):
    """GPTQ 4-bit, checkpoint_format "gptq" (v1 zero points), as gptqmodel writes by default; group
    128 symmetric in input order, and group 32 asymmetric with act-order (g_idx)."""
    path = gptqmodel_quantize(float_model, str(tmp_path / "gptq"), group_size=group, sym=sym, desc_act=desc_act)
    assert_serves_like(path, gptqmodel_reference(path, float_model, "gptq"), "gptq", "BlockLinear")


@needs_gptqmodel
@pytest.mark.parametrize("group", [128, 32])
def test_gptqmodel_awq_checkpoint_serves_like_gptqmodel(float_model, tmp_path, group):
    """AWQ 4-bit GEMM with zero points (sym=False: zero_point true, AutoAWQ's layout)."""
    path = gptqmodel_quantize(float_model, str(tmp_path / "awq"), group_size=group, sym=False,
                              quant_method="awq", format="gemm")
    assert_serves_like(path, gptqmodel_reference(path, float_model, "awq"), "awq", "BlockLinear")


@needs_gptqmodel
def test_gptqmodel_default_awq_is_refused_in_one_line(float_model, tmp_path):
    """gptqmodel's default AWQ (sym=True) writes zero_point false, its qzeros all 8: refused in one
    line (core/quant/hub/gptq.py awq_settings), not read as something else."""
    path = gptqmodel_quantize(float_model, str(tmp_path / "awq"), group_size=128, quant_method="awq",
                              format="gemm")
    assert_refused_in_one_line(path, "AWQ without zero points")


# --- llm-compressor ---

def llmcompressor_quantize(float_model: str, path: str, scheme: str, algorithm: str) -> str:
    import llmcompressor
    from datasets import Dataset
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(float_model)
    model = AutoModelForCausalLM.from_pretrained(float_model, dtype=torch.bfloat16)
    ids = calibration_ids(tokenizer)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    if algorithm == "gptq":
        recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"], actorder="weight")
        llmcompressor.oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(ids),
                              max_seq_length=64)
    else:  # round to nearest (min-max); the texts only pass through
        llmcompressor.oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
                                                                      ignore=["lm_head"]),
                              dataset=data, num_calibration_samples=len(ids))
    model.save_pretrained(path, save_compressed=True)
    tokenizer.save_pretrained(path)
    return path


@needs_llmcompressor
@pytest.mark.parametrize("scheme,algorithm,method,kernel", [
    ("W4A16", "gptq", "compressed-tensors", "BlockLinear"),  # group 128, symmetric, act-order "weight"
    ("W4A16_ASYM", "rtn", "compressed-tensors", "BlockLinear"),  # group 128, zero points
    ("W8A16", "rtn", "compressed-tensors", "BlockLinear"),  # 8-bit, group 128
    ("FP8_DYNAMIC", "rtn", "fp8", "Fp8Linear"),  # float8 e4m3 per channel; its dynamic activations dropped
])
def test_llmcompressor_checkpoint_serves_like_transformers(float_model, tmp_path, scheme, algorithm, method,
                                                           kernel):
    path = llmcompressor_quantize(float_model, str(tmp_path / "ct"), scheme, algorithm)
    assert_serves_like(path, compressed_reference(path), method, kernel)


@needs_llmcompressor
def test_llmcompressor_w8a8_is_refused_in_one_line(float_model, tmp_path):
    """Integer W8A8 (int8 weights per channel, int8 activations per token, format int-quantized)."""
    path = llmcompressor_quantize(float_model, str(tmp_path / "ct"), "W8A8", "rtn")
    assert_refused_in_one_line(path, "quantized activations (W8A8, W4A8; the CPU serves weight-only")
