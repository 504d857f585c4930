"""Adapters over pre-quantized Hub checkpoints: GPTQ (4-bit, act-order), AWQ (GEMM layout) and
bitsandbytes (nf4 with double quantization, LLM.int8), each a tiny random Llama saved in its
format and detected from its quantization_config. The adapter (PEFT's, made over the float base:
an adapter holds only its own matrices) is served over the quantized base; the reference is the
same quantized base served without LoRA, each targeted projection given PEFT's delta in plain torch
by a forward hook (lora_helpers.add_deltas_by_hooks): whatever kernel runs the base, the adapter
adds exactly its delta.

GPTQ and AWQ are written by core/testing/hub_layers.py's packers (the documented layouts, as
tests/core/hub_checkpoints.py does); bitsandbytes by transformers with bitsandbytes itself on the
CPU (as tests/backends/test_bnb_quant.py), skipped where that cannot run.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from lora_helpers import ATTENTION_AND_MLP, LogitsRecorder, add_deltas_by_hooks, make_adapter, make_engine, \
    prompts, run, save_base, tiny_llama_config
from safetensors.torch import load_file, save_file

from switchyard.core.config import ModelConfig
from switchyard.core.layers.linear import Linear
from switchyard.core.testing.hub_layers import AWQ_CONFIG, awq_pack, gptq_config, gptq_pack

GROUP = 32
# logits of up to ~4.5: measured up to 1.5e-4 (GPTQ, AWQ, LLM.int8: the delta summed in another
# order) and 4.1e-3 (nf4: bitsandbytes' CPU 4-bit kernel reads its input rows in bf16, so a delta
# added in another order may round a row's value the other way)
ATOL = 1e-2
KINDS = ("gptq", "awq", "bnb-nf4", "bnb-int8")
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def write_packed(float_dir: str, out: str, kind: str) -> str:
    """The float checkpoint at `float_dir` with every decoder linear packed as GPTQ or AWQ."""
    shutil.copytree(float_dir, out)
    file = os.path.join(out, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in ATTENTION_AND_MLP]:
        prefix, w = name.removesuffix(".weight"), tensors.pop(name)
        if kind == "gptq":
            packed, _ = gptq_pack(w, bits=4, group=GROUP, act_order=True, sym=False, v1=True, seed=len(tensors))
        else:
            packed, _ = awq_pack(w, GROUP, seed=len(tensors))
        tensors.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in packed.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = os.path.join(out, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["quantization_config"] = (gptq_config(4, GROUP, act_order=True, sym=False, v1=True) if kind == "gptq"
                                     else {**AWQ_CONFIG, "group_size": GROUP})
    with open(config_file, "w") as f:
        json.dump(config, f)
    return out


def write_bnb(float_dir: str, out: str, kind: str) -> str:
    """The float checkpoint quantized by transformers with bitsandbytes on the CPU, and saved."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    settings = (dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
                if kind == "bnb-nf4" else dict(load_in_8bit=True))
    try:
        model = AutoModelForCausalLM.from_pretrained(float_dir, device_map="cpu", dtype=torch.float32,
                                                     quantization_config=BitsAndBytesConfig(**settings))
    except Exception as error:  # an older transformers / bitsandbytes without CPU support
        pytest.skip(f"transformers cannot quantize with bitsandbytes on the CPU here: {error}")
    model.save_pretrained(out)
    for name in os.listdir(float_dir):  # the tokenizer's files
        if not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(float_dir, name), out)
    return out


@pytest.fixture(scope="module")
def float_base(tmp_path_factory, default_tokenizer):
    # hidden and intermediate sizes multiples of the group (GPTQ, AWQ) and of AWQ's 8 outputs a word
    return save_base(tiny_llama_config(), tmp_path_factory.mktemp("float-base"), default_tokenizer)


def kernels(engine) -> set[str]:
    """The module classes that run the decoder linears of an engine's model (under LoRA's wrappers)."""
    modules = [m for n, m in engine.loaded.model.named_modules() if n.endswith(LINEARS)]
    return {type(getattr(m, "base", m)).__name__ for m in modules}


@pytest.mark.parametrize("kind", KINDS)
def test_an_adapter_over_a_quantized_checkpoint_adds_its_delta(kind, float_base, tmp_path):
    base = (write_packed if kind in ("gptq", "awq") else write_bnb)(float_base, str(tmp_path / kind), kind)
    make_adapter(float_base, tmp_path / "adapter", seed=2, r=4, alpha=8)
    served = make_engine(base, adapters=[("a", tmp_path / "adapter")], model=ModelConfig(model=base))
    assert served.config.model.quantize is not None, "the checkpoint's quantization was not detected"
    recorder = LogitsRecorder(served)
    prompt, other = prompts(count=2)
    tokens = run(served, [("lora", prompt, "a"), ("base", prompt, None), ("lora-2", other, "a")])
    assert tokens["lora"] != tokens["base"], "the adapter changes nothing: the test shows nothing"
    ours = {rid: torch.stack(rows) for rid, rows in recorder.rows.items()}
    served_kernels = kernels(served)
    del served

    reference = make_engine(base, enable=False, model=ModelConfig(model=base))
    assert kernels(reference) == served_kernels and Linear.__name__ not in served_kernels, served_kernels
    add_deltas_by_hooks(reference, tmp_path / "adapter", 8 / 4)
    expected = LogitsRecorder(reference)
    assert run(reference, [("lora", prompt, None), ("lora-2", other, None)]) == \
        {"lora": tokens["lora"], "lora-2": tokens["lora-2"]}
    for rid in ("lora", "lora-2"):
        torch.testing.assert_close(ours[rid], torch.stack(expected.rows[rid]), atol=ATOL, rtol=0)
