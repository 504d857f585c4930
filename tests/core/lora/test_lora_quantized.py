"""An adapter over the default model as `switchyard serve` runs it: its GGUF file's packed blocks
multiplied in integers (BlockLinear), every token a decode row, and decode steps prepared
(compile_decode: the C++ layers, which run every step, adapter rows' deltas included). The
reference is the same base engine without LoRA and without the C++ layers (the model's layers),
each targeted projection given PEFT's delta in plain torch by a forward hook."""
from __future__ import annotations

import pytest
import torch
from lora_helpers import LogitsRecorder, add_deltas_by_hooks, run

from switchyard.backends.cpu.quant import BlockLinear
from switchyard.core.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.testing.lora_adapters import default_model_adapter

LAYERS = [0, 7, 29]
PROMPT = [1, 4093, 314, 253, 1345, 28, 6357, 30, 27, 3160]  # any ids of the vocabulary
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_default_model_adapter(path) -> tuple[int, float]:
    """PEFT's adapter over the default model's shapes (q, v, down of LAYERS; rank 8); its rank and scale."""
    default_model_adapter(path, 8, ["q_proj", "v_proj", "down_proj"], layers=LAYERS)
    return 8, 16 / 8


def engine(lora: LoraConfig | None, compile_decode: bool) -> EngineCore:
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_blocks=32), compile_decode=compile_decode,
                          backend="cpu", lora=lora or LoraConfig())
    return EngineCore(config)


@pytest.mark.slow
def test_an_adapter_on_the_default_gguf_model_equals_its_reference(tmp_path):
    _, scale = make_default_model_adapter(tmp_path / "adapter")
    served = engine(LoraConfig(adapters=(("a", str(tmp_path / "adapter")),), max_loras=2, max_lora_rank=8),
                    compile_decode=True)
    assert served.runner.by_row and any(isinstance(m, BlockLinear) for m in served.loaded.model.modules())
    recorder = LogitsRecorder(served)
    tokens = run(served, [("lora", PROMPT, "a"), ("base", PROMPT, None)], PARAMS)
    assert tokens["lora"] != tokens["base"], "the adapter changes nothing: the test shows nothing"
    ours = {rid: torch.stack(rows) for rid, rows in recorder.rows.items()}
    fused_before = served.runner.num_fused_steps
    assert run(served, [("base-alone", PROMPT, None)], PARAMS)["base-alone"] == tokens["base"]
    assert served.runner.num_fused_steps > fused_before  # a step without adapter rows: the C++ layers
    del served

    reference = engine(None, compile_decode=False)  # the model's layers, no LoRA
    add_deltas_by_hooks(reference, tmp_path / "adapter", scale)
    expected = LogitsRecorder(reference)
    assert run(reference, [("lora", PROMPT, None)], PARAMS)["lora"] == tokens["lora"]
    # the C++ layers' float32 sums against the model's layers': the base model alone differs by up
    # to 2.4e-3 (11k of these 295k logits by more than 1e-3), adapter or not
    torch.testing.assert_close(ours["lora"], torch.stack(expected.rows["lora"]), atol=4e-3, rtol=2e-3)


def test_an_adapter_over_int8_weights_made_at_load(tmp_path, default_tokenizer):
    from lora_helpers import make_adapter, make_engine, prompts, save_base, tiny_llama_config

    from switchyard.backends.cpu.quant import Int8Linear

    base = save_base(tiny_llama_config(), tmp_path / "base", default_tokenizer)
    make_adapter(base, tmp_path / "adapter", seed=2, r=4, alpha=8)
    quantized = ModelConfig(model=base, quantize="int8")
    served = make_engine(base, adapters=[("a", tmp_path / "adapter")], model=quantized)
    assert any(isinstance(m, Int8Linear) for m in served.loaded.model.modules())
    recorder = LogitsRecorder(served)
    requests = [("r", prompts(count=1)[0], "a")]
    tokens = run(served, requests)["r"]
    reference = make_engine(base, enable=False, model=quantized)
    add_deltas_by_hooks(reference, tmp_path / "adapter", 8 / 4)
    expected = LogitsRecorder(reference)
    assert run(reference, [("r", prompts(count=1)[0], None)])["r"] == tokens
    # the int8 kernel quantizes its input rows too: a delta summed in another order may round a code
    # the other way, by a step of the row's scale
    torch.testing.assert_close(torch.stack(recorder.rows["r"]), torch.stack(expected.rows["r"]), atol=2e-2, rtol=2e-2)
