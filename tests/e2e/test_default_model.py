"""The default model (SmolLM2-135M-Instruct, GGUF) end to end through the real engine on CPU."""
import os

import pytest
import torch

from switchyard.core import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=1024, quantize="none")  # floats: compared with transformers token for token


@pytest.fixture(scope="module")
def hf_model(default_gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf_path),
                                                 gguf_file=os.path.basename(default_gguf_path),
                                                 dtype=torch.float32)
    return model.eval()


def test_greedy_equals_transformers_token_for_token(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, ours):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        expected = out[0, ids.shape[1]:].tolist()
        assert len(expected) == 32
        assert list(result.token_ids) == expected, prompt


def test_batch_invariance_16_concurrent_greedy_requests(llm):
    prompts = [f"Write a short note number {i} about {topic}:" for i, topic in
               enumerate(["cats", "rivers", "trains", "bread"] * 4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, result in zip(prompts, together):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == result.token_ids, prompt


def test_chat_knows_the_capital_of_france(llm):
    result = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "eos"  # ended on <|im_end|>, not the length limit


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Tell me a story:"], params)[0]
    crowd = llm.generate(["Tell me a story:"] + [f"Noise {i}" for i in range(5)],
                         [params] + [SamplingParams(temperature=1.0, max_tokens=20)] * 5)[0]
    assert alone.token_ids == crowd.token_ids
    different = llm.generate(["Tell me a story:"], SamplingParams(temperature=0.9, top_p=0.95, seed=43,
                                                                  max_tokens=20, ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_stop_strings_and_stop_ids_and_max_tokens(llm):
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop = free.text.strip().split(",")[1].strip()  # a number the model is about to write
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))[0]
    assert stopped.finish_reason == "stop_string" and stop not in stopped.text
    assert free.text.startswith(stopped.text)
    stop_id = free.token_ids[3]
    by_id = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    assert by_id.finish_reason == "stop_token" and by_id.token_ids[-1] == stop_id
    assert by_id.outputs[0].stop_reason == stop_id


def test_n_samples_and_token_id_prompts(llm):
    ids = llm.tokenizer.encode("Hello")
    result = llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))[0]
    assert len(result.outputs) == 3 and result.prompt_token_ids == tuple(ids)
    assert len({o.token_ids for o in result.outputs}) > 1


def test_preemption_under_memory_pressure_gives_the_same_output():
    prompts = [f"List {i} facts about the moon:" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(num_kv_blocks=256, quantize="none").generate(prompts, params)
    tight_llm = LLM(num_kv_blocks=14, block_size=16, quantize="none")  # 13 usable blocks < 6 requests x 4 blocks
    tight = tight_llm.generate(prompts, params)
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    scheduler = tight_llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 13  # every block came back


def test_generate_command_line():
    """The chat answer of the dequantized floats. The packed Q4_1 file's own answer depends on the
    CPU: its int8-rounded activations move the output head's top two logits (0.08 apart here) past
    each other on an AVX2 EPYC in float32, where llama-server gives the same "L'Étoile, la
    Marseillaise" as the packed path, and not on an AMX Xeon in bf16."""
    import subprocess

    out = subprocess.run(["switchyard", "generate", "--chat", "--quantize", "none", "--max-tokens", "24",
                          "What is the capital of France?"], check=True, capture_output=True, text=True, timeout=300)
    assert "Paris" in out.stdout
