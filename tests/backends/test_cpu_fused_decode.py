"""The CPU backend's fused decode layers (backends/cpu/fused_decode.py, csrc/decode_layers.cpp)
against the model's own forward: the same logits (float32 within rounding, bfloat16 within its
step) and the same greedy tokens, for every shape the Llama layout covers (GQA, q/k/v bias,
per-head q/k norms, partial rotary, a sliding window, scaled rope), every linear kind
(oneDNN-packed, dense, block-quantized, int8, int4, bf16 row kernel), a quantized KV cache
(--kv-cache-dtype, written and read by the C++), and the fallbacks when a model or a module
has no fused path."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.compiled import CompiledDecodeRunner
from switchyard.backends.cpu.fused_decode import FusedDecodeRunner, fused_program, linear_operands, load_decode_layers
from switchyard.core.backend import KV_CACHE_FORMATS
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.loader.gguf_cache import default_cache_root
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.execution.runner import ModelRunner
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput

BLOCK = 4
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
SHAPES = {
    "llama-gqa": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5, "num_key_value_heads": 4}),
    "mistral-window": ("mistral", {"sliding_window": 6, "head_dim": 16}),
}


def model_dir(tmp_path_factory, shape: str) -> str:
    model_type, overrides = SHAPES[shape]
    path = tmp_path_factory.mktemp(shape)
    AutoConfig.for_model(model_type, **{**TINY, **overrides}).save_pretrained(path)
    return str(path)


def engine(model: str, dtype: str, fused: bool, quantize: str | None = None, backend=None,
           load_format: str = "dummy", kv_cache_dtype: str = "auto") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=model, load_format=load_format, seed=5, max_model_len=128, dtype=dtype, quantize=quantize),
        cache=CacheConfig(block_size=BLOCK, num_blocks=96, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128), compile_decode=fused)
    return EngineCore(config, backend=backend or CpuBackend())


PROMPTS = {"a": list(range(3, 14)), "b": [7, 8, 9], "c": list(range(40, 61))}  # 11, 3 and 21 tokens
BLOCKS = {"a": (9, 4, 17, 2), "b": (5, 1), "c": (3, 11, 6, 8, 12, 13, 14)}


def decode_logits(core: EngineCore, steps: int = 3) -> list[torch.Tensor]:
    """Prefills PROMPTS in one step (the model's forward), then decodes `steps` steps of fixed
    tokens through the engine's runner: the logits of each decode step."""
    runner = core.runner
    prefill = tuple(ScheduledRequest(k, tuple(p), 0, BLOCKS[k], True) for k, p in PROMPTS.items())
    ModelRunner.execute(runner, SchedulerOutput(prefill))
    out = []
    for step in range(steps):
        decodes = tuple(ScheduledRequest(k, (20 + step + i,), len(p) + step, BLOCKS[k], True)
                        for i, (k, p) in enumerate(PROMPTS.items()))
        logits, ids = runner.execute(SchedulerOutput(decodes))
        assert ids == tuple(PROMPTS)
        out.append(logits)
    return out


def greedy(core: EngineCore) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for key, prompt in PROMPTS.items():
        core.add_request(Request(key, list(prompt), params))
    out = {key: [] for key in PROMPTS}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_decode_steps_match_the_model_forward_in_float32(shape, tmp_path_factory):
    path = model_dir(tmp_path_factory, shape)
    eager, fused = engine(path, "float32", False), engine(path, "float32", True)
    assert isinstance(fused.runner, FusedDecodeRunner)
    for expected, got in zip(decode_logits(eager), decode_logits(fused), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert fused.runner.num_fused_steps == 3
    assert greedy(fused) == greedy(eager)


@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qk-norm", "mistral-window"])
def test_fused_decode_steps_match_the_model_forward_in_bfloat16(shape, tmp_path_factory):
    """bf16: the same rounding points as the eager layers, different summation orders, so the
    logits agree within a few bf16 steps of their scale."""
    path = model_dir(tmp_path_factory, shape)
    eager, fused = engine(path, "bfloat16", False), engine(path, "bfloat16", True)
    for expected, got in zip(decode_logits(eager), decode_logits(fused), strict=True):
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 0.03 * scale
        assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_linears_take_the_fused_path(quantize, tmp_path_factory):
    """int4 makes q4_1 blocks (the block kernel), the head int8: the C++ calls the same kernels
    the modules do, one row (the kernel) and a batch past QUANTIZED_BATCH_ROWS alike."""
    path = model_dir(tmp_path_factory, "llama-gqa")
    eager, fused = engine(path, "bfloat16", False, quantize), engine(path, "bfloat16", True, quantize)
    assert isinstance(fused.runner, FusedDecodeRunner)
    for expected, got in zip(decode_logits(eager), decode_logits(fused), strict=True):
        assert (got - expected).abs().max().item() <= 0.03 * expected.abs().max().item()


@pytest.mark.parametrize("packing,row_limit", [("float32", 8), ("float32", 1), ("bfloat16", 3), ("bfloat16", 2)])
def test_bf16_weights_take_the_row_kernel_for_few_rows(packing, row_limit, tmp_path_factory, monkeypatch):
    """The C++ multiplies few rows (up to row_limit) with the bf16 row kernel and more (row_limit 1
    or 2: these 3-row steps) through oneDNN: where oneDNN packs no bf16 (an AVX2 CPU; forced here) its
    float32 packing, beside a bf16 packing (AVX-512 BF16) that one; agreeing with the model's
    forward without the row kernel (with a q/k/v bias)."""
    from switchyard.backends.cpu import backend as backend_module
    from switchyard.backends.cpu import fused_decode
    from switchyard.backends.cpu import linear as linear_module

    if packing == "float32":
        monkeypatch.setattr(linear_module, "packable_dtypes", lambda: (torch.float32,))
        monkeypatch.setattr(linear_module, "ROWS_BESIDE_FLOAT32", row_limit)
    elif torch.bfloat16 not in linear_module.packable_dtypes():
        pytest.skip("oneDNN packs no bf16 on this CPU")
    else:
        monkeypatch.setattr(linear_module, "ROWS_BESIDE_BF16", row_limit)
    path = model_dir(tmp_path_factory, "qwen2-bias")
    monkeypatch.setattr(backend_module, "rows_kernel_rows", lambda dtype: 0)
    eager = engine(path, "bfloat16", False)
    monkeypatch.setattr(backend_module, "rows_kernel_rows", linear_module.rows_kernel_rows)
    fused = engine(path, "bfloat16", True)
    assert isinstance(fused.runner, FusedDecodeRunner)
    qkv = fused.runner.layout.layers[0].qkv
    assert linear_operands(qkv, torch.bfloat16)[1][:4] == [fused_decode.ROWS, qkv.out_features, 0, row_limit]
    for expected, got in zip(decode_logits(eager), decode_logits(fused), strict=True):
        assert (got - expected).abs().max().item() <= 0.03 * expected.abs().max().item()
        assert (got.argmax(-1) == expected.argmax(-1)).all()


def forced_argmax(core: EngineCore, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """Teacher-forced: prefills PROMPTS, then decodes `tokens` (one per request a step) through
    the engine's runner: the argmax after each, so that one near-tie does not shift the rest."""
    runner = core.runner
    blocks = {k: tuple(range(12 * i, 12 * i + 12)) for i, k in enumerate(PROMPTS)}  # 48 tokens each
    ModelRunner.execute(runner, SchedulerOutput(tuple(ScheduledRequest(k, tuple(p), 0, blocks[k], True)
                                                      for k, p in PROMPTS.items())))
    out = {k: [] for k in PROMPTS}
    for step in range(len(tokens[next(iter(PROMPTS))])):
        logits, ids = runner.execute(SchedulerOutput(tuple(
            ScheduledRequest(k, (tokens[k][step],), len(p) + step, blocks[k], True) for k, p in PROMPTS.items())))
        for k, row in zip(ids, logits):
            out[k].append(int(row.argmax()))
    return out


def test_default_model_gguf_greedy_tokens_agree_with_the_eager_engine(default_gguf_path):
    """The real model, its own Q4_1 / Q8_0 blocks (block kernel, tied q8_0 head and embedding):
    the eager engine's greedy tokens, fed to both, are predicted alike (these random prompts
    have near-ties, where the two rounding orders may pick either)."""
    eager, fused = (engine(default_gguf_path, "bfloat16", f, "gguf", load_format="auto")
                     for f in (False, True))
    assert isinstance(fused.runner, FusedDecodeRunner)
    reference = greedy(eager)
    ours, theirs = forced_argmax(fused, reference), forced_argmax(eager, reference)
    assert all(theirs[k][:-1] == reference[k][1:] for k in PROMPTS)  # the eager engine's own choices
    assert sum(a == b for key in ours for a, b in zip(ours[key], theirs[key])) >= 0.9 * 36
    assert fused.runner.num_fused_steps >= 12


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_CACHE_FORMATS))
@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qk-norm", "mistral-window"])
def test_fused_decode_steps_write_and_read_a_quantized_kv_cache(kv_cache_dtype, shape, tmp_path_factory):
    """The C++ layers quantize each head's k and v into the cache (kv_rows.h) and attend over the
    codes, as the model's forward does through the kernel (core/kv/quantized.py): the same logits
    within float rounding (a k or v differing in its last bit may round to the next code) and
    the same greedy tokens; the decode steps' rows hold codes and scales."""
    path = model_dir(tmp_path_factory, shape)
    eager, fused = (engine(path, "float32", f, kv_cache_dtype=kv_cache_dtype) for f in (False, True))
    assert isinstance(fused.runner, FusedDecodeRunner)
    assert {cache.dtype for cache in fused.runner.kv_caches} == {KV_CACHE_FORMATS[kv_cache_dtype]}
    for expected, got in zip(decode_logits(eager), decode_logits(fused), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert fused.runner.num_fused_steps == 3
    written = fused.runner.kv_caches[0].view(torch.uint8).flatten(1, 2)[:, BLOCK * BLOCKS["b"][1] + 1]  # b's 3rd decode
    assert written[..., -4:].contiguous().view(torch.float32).gt(0).all()  # a scale per head, keys and values
    assert greedy(fused) == greedy(eager)


def test_padding_rows_write_no_kv(tmp_path_factory):
    """A negative slot (a padding row) attends but leaves the cache as it was."""
    core = engine(model_dir(tmp_path_factory, "llama-gqa"), "float32", True)
    runner = core.runner
    before = [cache.clone() for cache in runner.kv_caches]
    hidden = torch.randn(1, 64)
    cos, sin = runner.layout.rotary(torch.tensor([3]), torch.float32)
    runner.program.forward(hidden, cos, sin, runner.kv_caches, torch.tensor([-1]),
                           torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                           torch.empty(0))  # no LoRA token slots
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))


def test_models_without_the_layout_keep_their_own_path(tmp_path_factory):
    """A mixture-of-experts model declares no layout: its decode steps compile (or run eager)."""
    path = tmp_path_factory.mktemp("moe")
    AutoConfig.for_model("qwen2_moe", **{**TINY, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
                         ).save_pretrained(path)
    core = engine(str(path), "float32", False)
    assert core.runner.model.decoder_layout() is None
    assert fused_program(None, load_decode_layers(default_cache_root()), torch.float32).startswith(
        "the model does not declare")


def test_fused_decode_can_be_switched_off(tmp_path_factory):
    core = engine(model_dir(tmp_path_factory, "llama-gqa"), "float32", True, backend=CpuBackend(fused_decode=False))
    assert isinstance(core.runner, CompiledDecodeRunner)


def test_a_module_without_a_fused_kernel_is_named():
    assert linear_operands(torch.nn.Linear(4, 4), torch.float32) == "no fused path for Linear"


def test_a_binary_without_the_class_is_unavailable(monkeypatch):
    """As under another torch's ABI: the library loads but registers no DecodeLayers."""
    from switchyard.backends.cpu import fused_decode
    from switchyard.backends.cpu.extension import ExtensionBuild

    monkeypatch.setattr(fused_decode, "build_extension",
                        lambda *args: ExtensionBuild(torch.ops.aten, "", "/tmp/switchyard_no_such_build", 0.0, True))
    build = load_decode_layers(default_cache_root())
    assert not build.available and "no DecodeLayers class" in build.reason
    assert fused_program(object(), build, torch.float32).startswith("the fused decode kernel is unavailable")
