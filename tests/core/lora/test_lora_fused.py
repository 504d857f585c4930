"""Steps with adapter rows on the CPU's fused C++ decode layers (backends/cpu/fused_decode.py,
csrc/decode_layers.cpp with csrc/lora.h): they stay in C++, and give the tokens of the model's
wrapped layers (core/lora/layers.py), logits within the fused layers' float32 tolerance of the eager
engine (1e-4, as tests/backends/test_cpu_fused_decode.py: the base layers' sums are not the
eager ones' bits; the deltas are lora.h's arithmetic on both paths). An adapter of the embedding
sends steps with adapter rows to the model's layers."""
from __future__ import annotations

import torch
from lora_helpers import LogitsRecorder, make_adapter, make_engine, prompts, reference_greedy, run

ATOL = 1e-4


class CountingProgram:
    """The runner's DecodeLayers, counting the calls that carried adapter rows."""

    def __init__(self, program):
        self.program = program
        self.adapter_calls = 0

    def forward(self, *args):
        self.adapter_calls += int(args[-1].numel() > 0)
        return self.program.forward(*args)


def test_adapter_steps_stay_in_the_fused_layers_and_match_the_wrapped_layers(llama_dir, tmp_path):
    make_adapter(llama_dir, tmp_path / "a", seed=21, r=4)
    make_adapter(llama_dir, tmp_path / "b", seed=22, r=6, targets=["q_proj", "v_proj", "down_proj", "lm_head"])
    adapters = [("a", tmp_path / "a"), ("b", tmp_path / "b")]
    fused = make_engine(llama_dir, adapters=adapters, compile_decode=True)
    assert fused.runner.lora_fallback is None
    counting = fused.runner.program = CountingProgram(fused.runner.program)
    eager = make_engine(llama_dir, adapters=adapters)
    assert not hasattr(eager.runner, "program")
    requests = [(f"r{i}-{n}", p, n) for i, (p, n) in enumerate(zip(prompts(count=4), ["a", None, "b", "a"]))]
    ours, theirs = LogitsRecorder(fused), LogitsRecorder(eager)
    tokens = run(fused, requests)
    assert tokens == run(eager, requests)
    assert counting.adapter_calls > 0, "no step with adapter rows took the fused layers"
    for rid, _, _ in requests:
        torch.testing.assert_close(torch.stack(ours.rows[rid]), torch.stack(theirs.rows[rid]), atol=ATOL, rtol=ATOL,
                                   msg=rid)
    calls = counting.adapter_calls  # a request alone: each decode step with its adapter in C++
    alone = run(fused, [("alone", requests[2][1], "b")])["alone"]
    assert counting.adapter_calls - calls >= len(alone) - 1  # (the prompt step too where its prefix was cached)
    assert alone == tokens["r2-b"]


def test_an_embedding_adapter_runs_its_steps_through_the_model_layers(llama_dir, tmp_path):
    merged = make_adapter(llama_dir, tmp_path / "e", seed=23, r=3, targets=["embed_tokens", "v_proj"])
    engine = make_engine(llama_dir, adapters=[("e", tmp_path / "e")], compile_decode=True)
    assert engine.runner.lora_fallback == "an adapter of the embedding"
    counting = engine.runner.program = CountingProgram(engine.runner.program)
    prompt = prompts(count=1)[0]
    tokens = run(engine, [("e", prompt, "e")])["e"]
    assert counting.adapter_calls == 0
    assert tokens == reference_greedy(merged, prompt, len(tokens))


def test_a_change_to_the_shared_kernel_header_rebuilds_both_extensions(tmp_path):
    """lora.h is compiled into csrc/lora.cpp's and csrc/decode_layers.cpp's binaries: a change to it
    changes both build names (extension.py hashes the headers beside a source)."""
    import shutil

    from switchyard.backends.cpu.extension import SOURCES, build_name

    shutil.copytree(SOURCES, tmp_path / "csrc")
    sources = [str(tmp_path / "csrc" / name) for name in ("lora.cpp", "decode_layers.cpp")]
    before = [build_name(source, str(tmp_path)) for source in sources]
    with open(tmp_path / "csrc" / "lora.h", "a") as header:
        header.write("\n// changed\n")
    assert all(a != b for a, b in zip(before, [build_name(source, str(tmp_path)) for source in sources]))
