"""llama.cpp's LoRA GGUF adapters (core/lora/gguf_adapter.py) served as the PEFT directory they
were made from: the same tokens and the same logits, in one batch with the base and the PEFT
adapter itself.

Two ways to make the file: llama.cpp's own converter (convert_lora_to_gguf.py, run by subprocess
in its side environment: skipped where that is absent, as on CI), and a writer that follows the
converter's layout by hand (core/testing/lora_gguf.py: its names, token_embd's transposed lora_a,
the q/k lora_b rows permuted as convert_hf_to_gguf's LlamaModel.permute does), independent of the
reader's name table.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from lora_helpers import LogitsRecorder, make_adapter, make_engine, prompts, reference_greedy, run, save_base, \
    tiny_llama_config

from switchyard.core.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.lora.adapter import LoraAdapterError
from switchyard.core.params import SamplingParams
from switchyard.core.testing.lora_gguf import stored, write_gguf_adapter

PEERS = Path.home() / ".cache" / "switchyard-peers"
CONVERT_PYTHON = PEERS / "convert-venv" / "bin" / "python"
CONVERTER = PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_lora_to_gguf.py"
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


def as_stored(tensor: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """The values a reader should get back of a tensor written as `tensor_type`."""
    from gguf.quants import dequantize

    data, raw_dtype = stored(tensor, tensor_type)
    if raw_dtype is None:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(np.asarray(dequantize(data, raw_dtype), dtype=np.float32)).reshape(tensor.shape)


def logits_by_request(recorder: LogitsRecorder) -> dict[str, torch.Tensor]:
    return {rid: torch.stack(rows) for rid, rows in recorder.rows.items()}


def test_a_gguf_adapter_in_llama_cpps_layout_serves_as_its_peft_directory(llama_dir, tmp_path):
    merged = make_adapter(llama_dir, tmp_path / "peft", seed=5, r=4, alpha=8, targets=ALL_TARGETS)
    gguf_file = write_gguf_adapter(tmp_path / "peft", tmp_path / "adapter.gguf", tiny_llama_config())
    engine = make_engine(llama_dir, adapters=[("peft", tmp_path / "peft"), ("gguf", gguf_file)])
    recorder = LogitsRecorder(engine)
    first, second = prompts(count=2)
    tokens = run(engine, [("peft", first, "peft"), ("gguf", first, "gguf"), ("base", first, None),
                          ("gguf-2", second, "gguf"), ("peft-2", second, "peft")])
    assert tokens["gguf"] != tokens["base"], "the adapter changes nothing: the test shows nothing"
    assert tokens["gguf"] == tokens["peft"] == reference_greedy(merged, first, len(tokens["gguf"]))
    assert tokens["gguf-2"] == tokens["peft-2"]
    logits = logits_by_request(recorder)
    assert torch.equal(logits["gguf"], logits["peft"]) and torch.equal(logits["gguf-2"], logits["peft-2"])


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0"])
def test_tensor_types_are_read_as_written(llama_dir, tmp_path, tensor_type):
    make_adapter(llama_dir, tmp_path / "peft", seed=6, r=4, alpha=8)
    gguf_file = write_gguf_adapter(tmp_path / "peft", tmp_path / "adapter.gguf", tiny_llama_config(),
                                   tensor_type=tensor_type)
    engine = make_engine(llama_dir, enable=True)
    peft, read = engine.lora.read("peft", str(tmp_path / "peft")), engine.lora.read("gguf", gguf_file)
    assert read.weights.keys() == peft.weights.keys() and len(read.weights) == 2 * 7
    for key, expected in peft.weights.items():
        got = read.weights[key]
        want_a, want_b = as_stored(expected.a, tensor_type), as_stored(expected.b, tensor_type)
        assert not torch.equal(want_a, expected.a), "the type rounds nothing: the test shows nothing"
        assert torch.equal(got.a, want_a) and torch.equal(got.b, want_b), key
        assert got.scale == expected.scale == 2.0


def bad_gguf_adapters(llama_dir, tmp_path, default_tokenizer) -> dict[str, tuple[str, str]]:
    """case -> (path, what the error says)."""
    config = tiny_llama_config()
    tmp_path.mkdir()
    make_adapter(llama_dir, tmp_path / "peft", seed=2, r=4, alpha=8)
    peft = tmp_path / "peft"
    cases = {}

    def case(label, message, **options):
        cases[label] = (write_gguf_adapter(peft, tmp_path / f"{label.replace(' ', '-')}.gguf", config, **options),
                        message)

    case("a model", "is not an adapter", header={"general.type": "model"})
    case("no general.type", "is not an adapter", header={"general.type": None})
    case("not lora", "is not LoRA", header={"adapter.type": "control_vector"})
    case("no alpha", "has no number adapter.lora.alpha", header={"adapter.lora.alpha": None})
    case("activated lora", "activated LoRA", header={"adapter.alora.invocation_tokens": [5, 6]})
    case("unknown tensor", "tensor blk.0.attn_rot.weight \\(llama\\) is not a layer an adapter may target",
         rename={"blk.0.attn_q.weight.lora_a": "blk.0.attn_rot.weight.lora_a",
                 "blk.0.attn_q.weight.lora_b": "blk.0.attn_rot.weight.lora_b"})
    case("not a lora tensor", "'blk.1.ffn_down.weight.lora_c' is not a lora_a or lora_b matrix",
         rename={"blk.1.ffn_down.weight.lora_b": "blk.1.ffn_down.weight.lora_c"})
    case("only lora_a", "tensor blk.1.attn_v.weight has \\['lora_a'\\], not lora_a and lora_b",
         drop=("blk.1.attn_v.weight.lora_b",))
    other = save_base(tiny_llama_config(hidden_size=32), tmp_path / "other-base", default_tokenizer)
    make_adapter(other, tmp_path / "wrong", seed=2, r=4, alpha=8)
    cases["wrong shapes"] = (write_gguf_adapter(tmp_path / "wrong", tmp_path / "wrong.gguf",
                                                tiny_llama_config(hidden_size=32)),
                             "module blk.0.attn_k.weight \\(model.layers.0.self_attn.k_proj\\) has A \\(4, 32\\)")
    make_adapter(llama_dir, tmp_path / "big", seed=2, r=16, alpha=8)
    cases["rank too big"] = (write_gguf_adapter(tmp_path / "big", tmp_path / "big.gguf", config),
                             "rank 16, more than the largest rank served, 8")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(40)))
    cases["not gguf"] = (str(garbage), "cannot be read as a GGUF file")
    return cases


def test_bad_gguf_adapters_are_refused_clearly_and_change_nothing(llama_dir, tmp_path, default_tokenizer):
    make_adapter(llama_dir, tmp_path / "good", seed=3, r=4, alpha=8)
    good = write_gguf_adapter(tmp_path / "good", tmp_path / "good.gguf", tiny_llama_config())
    engine = make_engine(llama_dir, adapters=[("good", good)])
    prompt = prompts(count=1)[0]
    before = run(engine, [("before", prompt, "good")])["before"]
    for label, (path, message) in bad_gguf_adapters(llama_dir, tmp_path / "bad", default_tokenizer).items():
        with pytest.raises(LoraAdapterError, match=message) as error:
            engine.load_lora("bad", path)
        assert "'bad'" in str(error.value) and "\n" not in str(error.value), label
        assert engine.lora.names == ("good",), label
    assert run(engine, [("after", prompt, "good")])["after"] == before


@pytest.mark.slow
@pytest.mark.skipif(not (CONVERT_PYTHON.exists() and CONVERTER.exists()),
                    reason=f"llama.cpp's converter and its environment are not here ({CONVERTER}, {CONVERT_PYTHON})")
def test_llama_cpps_converter_output_serves_as_its_peft_directory_on_the_default_model(tmp_path):
    from switchyard.core.loader import choose_model
    from switchyard.core.models.plain_config import transformers_config
    from switchyard.core.testing.lora_adapters import default_model_adapter

    default_model_adapter(tmp_path / "peft", 8, ["q_proj", "k_proj", "v_proj", "down_proj"], layers=[0, 7, 29])
    config = transformers_config(choose_model(ModelConfig())[1])  # SmolLM2-135M's, from its GGUF
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / "base")  # all the converter reads of the base: config.json
    out = tmp_path / "adapter.gguf"
    done = subprocess.run([str(CONVERT_PYTHON), str(CONVERTER), "--base", str(tmp_path / "base"), "--outtype", "f32",
                           "--outfile", str(out), str(tmp_path / "peft")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    engine = EngineCore(EngineConfig(model=ModelConfig(), cache=CacheConfig(num_blocks=32), backend="cpu",
                                     lora=LoraConfig(adapters=(("peft", str(tmp_path / "peft")), ("gguf", str(out))),
                                                     max_loras=2, max_lora_rank=8)))
    recorder = LogitsRecorder(engine)
    prompt = [1, 4093, 314, 253, 1345, 28, 6357, 30, 27, 3160]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = run(engine, [("peft", prompt, "peft"), ("gguf", prompt, "gguf"), ("base", prompt, None)], params)
    assert tokens["gguf"] != tokens["base"], "the adapter changes nothing: the test shows nothing"
    assert tokens["gguf"] == tokens["peft"]
    logits = logits_by_request(recorder)
    assert torch.equal(logits["gguf"], logits["peft"])
