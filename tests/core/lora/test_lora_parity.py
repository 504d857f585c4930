"""Our engine's tokens and logits with PEFT adapters equal PEFT's merged model under transformers:
one adapter of each kind alone, and four adapters and the base model in one batch."""
from __future__ import annotations

import pytest
import torch
from lora_helpers import (LogitsRecorder, load_base, make_adapter, make_engine, prompts, reference_greedy,
                          reference_logits, run, save_base, tiny_llama_config)

ATOL = 1e-4


def assert_matches(engine, recorder, tokens, requests, references):
    for rid, prompt, adapter in requests:
        hf = references[adapter]
        expected = reference_logits(hf, prompt, tokens[rid])
        torch.testing.assert_close(torch.stack(recorder.rows[rid]), expected, atol=ATOL, rtol=ATOL,
                                   msg=f"{rid} ({adapter})")
        assert tokens[rid] == reference_greedy(hf, prompt, len(tokens[rid])), f"{rid} ({adapter})"


VARIANTS = {
    "attention and mlp": dict(r=4, alpha=8),
    "rslora with rank and alpha patterns": dict(r=6, alpha=5, use_rslora=True,
                                                rank_pattern={"layers.1.self_attn.q_proj": 2},
                                                alpha_pattern={"down_proj": 3}),
    "embedding and head": dict(r=3, alpha=6, targets=["embed_tokens", "lm_head", "v_proj"]),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_adapter_matches_peft_merged(llama_dir, tmp_path, variant):
    merged = make_adapter(llama_dir, tmp_path / "adapter", seed=3, **VARIANTS[variant])
    engine = make_engine(llama_dir, adapters=[("a", tmp_path / "adapter")])
    recorder = LogitsRecorder(engine)
    requests = [(f"r{i}", p, "a") for i, p in enumerate(prompts(count=2))]
    tokens = run(engine, requests)
    assert_matches(engine, recorder, tokens, requests, {"a": merged})
    base_tokens = run(engine, [("base", requests[0][1], None)])["base"]
    assert base_tokens != tokens["r0"], "the adapter changes nothing: the test shows nothing"


def test_qwen2_with_qkv_bias(tmp_path, default_tokenizer):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=95, bos_token_id=1, tie_word_embeddings=False)
    base = save_base(config, tmp_path / "qwen2", default_tokenizer)
    merged = make_adapter(base, tmp_path / "adapter", seed=5)
    engine = make_engine(base, adapters=[("q", tmp_path / "adapter")])
    recorder = LogitsRecorder(engine)
    requests = [("r0", prompts(count=1)[0], "q")]
    assert_matches(engine, recorder, run(engine, requests), requests, {"q": merged})


def test_four_adapters_and_the_base_in_one_batch_each_as_alone(llama_dir, tmp_path):
    references = {None: load_base(llama_dir)}
    for i, name in enumerate("abcd"):
        references[name] = make_adapter(llama_dir, tmp_path / name, seed=10 + i, r=2 + i)
    engine = make_engine(llama_dir, adapters=[(n, tmp_path / n) for n in "abcd"])
    recorder = LogitsRecorder(engine)
    requests = [(f"r-{name}", p, name) for name, p in zip(["a", None, "b", "c", "d"], prompts(count=5))]
    together = run(engine, requests)
    assert_matches(engine, recorder, together, requests, references)
    rows_together = {rid: torch.stack(rows) for rid, rows in recorder.rows.items()}
    for rid, prompt, adapter in requests:  # each alone, in the same engine
        recorder.rows.clear()
        alone = run(engine, [(rid, prompt, adapter)])
        assert alone[rid] == together[rid]
        torch.testing.assert_close(torch.stack(recorder.rows[rid]), rows_together[rid], atol=ATOL, rtol=ATOL)


def test_chunked_prompts_and_prompt_logprobs_with_an_adapter(llama_dir, tmp_path):
    """Prompts cut into chunks of 5 tokens give the same tokens, and prompt log-probabilities (the
    logits of prompt rows, core/lora/batch.py slice_batch) are the merged model's."""
    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import Request

    merged = make_adapter(llama_dir, tmp_path / "adapter", seed=4, r=4, targets=["q_proj", "o_proj", "lm_head"])
    whole = make_engine(llama_dir, adapters=[("a", tmp_path / "adapter")])
    chunked = make_engine(llama_dir, adapters=[("a", tmp_path / "adapter")], budget=5)
    requests = [(f"r{i}", p, "a") for i, p in enumerate(prompts(count=3))] + [("base", prompts(count=1)[0], None)]
    assert run(chunked, requests) == run(whole, requests)

    prompt = prompts(count=2)[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    chunked.add_request(Request("scored", prompt, params, lora_name="a"))
    scored = []
    while chunked.has_unfinished_requests():
        scored += [out.prompt_logprobs for out in chunked.step() if out.prompt_logprobs]
    with torch.inference_mode():
        expected = torch.log_softmax(merged(torch.tensor([prompt])).logits[0].float(), -1)
    ours = [logprob for _, logprob, _ in scored[0][1:]]
    reference = [float(expected[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]
    assert ours == pytest.approx(reference, abs=1e-4)


def test_the_offline_api_serves_an_adapter(llama_dir, tmp_path):
    """LLM(lora=...) and generate(lora_name=...)."""
    from switchyard.core.config import LoraConfig
    from switchyard.core.llm import LLM
    from switchyard.core.params import SamplingParams

    merged = make_adapter(llama_dir, tmp_path / "adapter", seed=6)
    prompt = prompts(count=1)[0]
    with LLM(llama_dir, backend="cpu", block_size=4, num_kv_blocks=64,
             lora=LoraConfig(adapters=(("a", str(tmp_path / "adapter")),), max_lora_rank=8)) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        tokens = llm.generate([prompt], params, lora_name="a")[0].outputs[0].token_ids
        assert list(tokens) == reference_greedy(merged, prompt, 6)
        llm.unload_lora("a")
        llm.load_lora("b", str(tmp_path / "adapter"))
        assert llm.generate([prompt], params, lora_name="b")[0].outputs[0].token_ids == tokens


def test_speculative_decoding_with_adapters_keeps_greedy_tokens(llama_dir, tmp_path):
    """n-gram proposals verified with each request's adapter (a verify's rows carry its slot)."""
    from switchyard.core.config import SpeculativeConfig

    make_adapter(llama_dir, tmp_path / "a", seed=8)
    repetitive = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # proposals that the n-gram lookup finds
    requests = [("a", repetitive, "a"), ("base", repetitive, None), ("a2", prompts(count=1)[0], "a")]
    plain = run(make_engine(llama_dir, adapters=[("a", tmp_path / "a")]), requests)
    speculating = make_engine(llama_dir, adapters=[("a", tmp_path / "a")],
                              speculative=SpeculativeConfig(num_speculative_tokens=3))
    proposed = []
    assert run(speculating, requests, on_step=lambda e: proposed.append(
        sum(s.num_draft_tokens for s in e.last_scheduler_output.scheduled))) == plain
    assert sum(proposed) > 0


def test_prepared_decode_steps_with_adapter_rows_match_peft(llama_dir, tmp_path):
    """compile_decode (as `switchyard serve`): steps with adapter rows (their deltas in the CPU's
    fused C++ layers, test_lora_fused.py) match PEFT; steps of base requests alone run them too."""
    merged = make_adapter(llama_dir, tmp_path / "a", seed=9)
    engine = make_engine(llama_dir, adapters=[("a", tmp_path / "a")], compile_decode=True)
    assert hasattr(engine.runner, "num_fused_steps"), type(engine.runner)
    recorder = LogitsRecorder(engine)
    requests = [("lora", prompts(count=1)[0], "a")]
    assert_matches(engine, recorder, run(engine, requests), requests, {"a": merged})
    fused = engine.runner.num_fused_steps
    base = run(engine, [("base", prompts(count=1)[0], None)])["base"]
    assert engine.runner.num_fused_steps > fused
    assert base == reference_greedy(load_base(llama_dir), prompts(count=1)[0], len(base))
