"""EngineCore on a tiny random-weight Llama through the real CPU backend."""
from types import MethodType, SimpleNamespace

import pytest
import torch

from switchyard.core.backend import DEFAULT_MEMORY_FRACTION, AttentionSpec, Backend
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore, num_kv_blocks_for
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import FinishReason, Request
from switchyard.core.execution.runner import build_step_input
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=95, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    default_tokenizer.save_pretrained(path)  # any tokenizer decodes ids < 96; the offline API needs one
    return str(path)


def make_engine(model_dir, num_blocks=64, budget=2048, block_size=4) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(model=model_dir),
                                   cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=budget), backend="cpu"))


def run(engine, prompts, params, abort_after=None):
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        steps += 1
        if abort_after and steps == abort_after[1]:
            engine.finish_request(abort_after[0], FinishReason.ABORT)
    return outputs


PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_abort_frees_every_block_and_leaves_the_others_alone(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    free_at_start = engine.scheduler.kv_cache_manager.num_free_blocks
    undisturbed = run(engine, PROMPTS, GREEDY)
    with_abort = run(engine, PROMPTS, GREEDY, abort_after=("r1", 3))
    assert len(with_abort["r1"]) < 12
    assert with_abort["r0"] == undisturbed["r0"] and with_abort["r2"] == undisturbed["r2"]
    assert engine.scheduler.kv_cache_manager.num_free_blocks == free_at_start


def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir):
    whole = run(make_engine(tiny_model_dir), PROMPTS, GREEDY)
    chunked = run(make_engine(tiny_model_dir, budget=5), PROMPTS, GREEDY)  # prompts split over several steps
    assert whole == chunked


def test_prompt_that_can_never_fit_is_rejected(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=4)  # 3 usable blocks of 4 tokens
    with pytest.raises(ValidationError):
        engine.add_request(Request("big", list(range(1, 40)), GREEDY))
    assert not engine.has_unfinished_requests()


def test_kv_capacity_is_sized_from_available_memory():
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=8, block_size=16, scale=1.0, dtype=torch.float32)
    loaded = SimpleNamespace(attention_spec=spec, num_layers=3)
    backend = SimpleNamespace(available_memory_bytes=lambda: 10 * 2**20)
    backend.num_kv_blocks = MethodType(Backend.num_kv_blocks, backend)  # the default policy
    bytes_per_block = 2 * 3 * 16 * 2 * 8 * 4
    sized = num_kv_blocks_for(CacheConfig(memory_fraction=0.5, max_auto_blocks=10**9), loaded, backend)
    assert sized == (5 * 2**20) // bytes_per_block
    default = num_kv_blocks_for(CacheConfig(max_auto_blocks=10**9), loaded, backend)
    assert default == int(10 * 2**20 * DEFAULT_MEMORY_FRACTION) // bytes_per_block
    assert num_kv_blocks_for(CacheConfig(num_blocks=77), loaded, backend) == 77  # the flag wins
    assert num_kv_blocks_for(CacheConfig(memory_fraction=0.5, max_auto_blocks=100), loaded, backend) == 100


def test_step_input_puts_decodes_first_and_maps_slots():
    out = SchedulerOutput((ScheduledRequest("prefill", (7, 8, 9), 2, (5, 6), True),
                           ScheduledRequest("decode", (4,), 5, (3, 2), True)))
    step = build_step_input(out, 4, torch.device("cpu"))
    assert step.sampling_request_ids == ("decode", "prefill")
    assert step.meta.num_decodes == 1
    assert step.input_ids.tolist() == [4, 7, 8, 9]
    assert step.positions.tolist() == [5, 2, 3, 4]
    # decode at position 5 -> block 2 (second entry), offset 1; prefill 2,3 -> block 5; 4 -> block 6
    assert step.meta.slot_mapping.tolist() == [2 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0]
    assert step.logits_indices.tolist() == [0, 3]
    assert step.meta.seq_lens_cpu == (6, 5)


def test_step_input_tensors_have_the_kernels_dtypes_and_a_zero_padded_block_table():
    out = SchedulerOutput((ScheduledRequest("short", (4,), 1, (3,), True),
                           ScheduledRequest("long", (1, 2, 3, 4, 5, 6), 3, (7, 8, 9), False)))
    step = build_step_input(out, 4, torch.device("cpu"))
    assert step.meta.block_table.tolist() == [[3, 0, 0], [7, 8, 9]]
    assert step.meta.slot_mapping.tolist() == [3 * 4 + 1] + [7 * 4 + 3] + [8 * 4 + i for i in range(4)] + [9 * 4]
    assert step.sampling_request_ids == ("short",) and step.logits_indices.tolist() == [0]
    assert [t.dtype for t in (step.input_ids, step.positions, step.logits_indices, step.meta.slot_mapping)] \
        == [torch.int64] * 4
    assert [t.dtype for t in (step.meta.block_table, step.meta.seq_lens, step.meta.query_start_loc)] \
        == [torch.int32] * 3


def test_offline_api_rejects_a_bad_batch_whole(tiny_model_dir):
    from switchyard.core.llm import LLM

    llm = LLM(model=tiny_model_dir, num_kv_blocks=8, block_size=4)
    with pytest.raises(ValidationError):
        llm.generate([[1, 2, 3], list(range(1, 60))], GREEDY)  # the second can never fit
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("budget", [2048, 5])  # one prefill, or prompts split over several chunks
def test_prompt_logprobs_match_a_full_forward_of_transformers(tiny_model_dir, budget):
    from transformers import LlamaForCausalLM

    engine = make_engine(tiny_model_dir, budget=budget)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", list(prompt), params))
    firsts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts  # only with the first token
                firsts[out.request_id] = out.prompt_logprobs
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    for i, prompt in enumerate(PROMPTS):
        scored = firsts[f"r{i}"]
        assert [s[0] for s in scored] == prompt
        assert scored[0][1] is None and scored[0][2] == ()
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        for j in range(1, len(prompt)):
            token, logprob, top = scored[j]
            assert logprob == pytest.approx(expected[j - 1, token].item(), abs=1e-4)
            assert [t for t, _ in top] == expected[j - 1].topk(3).indices.tolist()


def test_prompt_logprobs_are_not_repeated_when_a_chunked_prompt_is_preempted(tiny_model_dir):
    engine = make_engine(tiny_model_dir, budget=5)
    prompt = list(PROMPTS[0]) * 3
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)))
    engine.step()  # the first chunk is scored
    request = engine.scheduler.get_request("r")
    assert 0 < request.num_computed_tokens < len(prompt)
    engine.scheduler.running.remove(request)
    engine.scheduler._preempt(request)  # recomputed from the start, scored again
    scored = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            scored = out.prompt_logprobs if out.prompt_logprobs is not None else scored
    assert [entry[0] for entry in scored] == prompt
