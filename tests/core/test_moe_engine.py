"""Mixture-of-experts models through the whole engine (the offline LLM on the CPU
backend): a request's greedy output is the same alone and in a batch of 16, although
its tokens share each step's per-expert matmuls with the other requests' tokens."""
from __future__ import annotations

import pytest
import torch
from parity_helpers import one_thread, save_tiny
from test_moe import configs

from switchyard.core.llm import LLM
from switchyard.core.loader import dummy_tokenizer
from switchyard.core.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
assert one_thread  # the fixture, imported for pytest to find


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"engine-{request.param}")
    save_tiny(configs()[request.param], path, seed=4)
    dummy_tokenizer(128, 1, 2).save_pretrained(path)
    return LLM(model=str(path), backend="cpu", max_model_len=64, block_size=8, max_num_batched_tokens=64)


def test_greedy_output_is_the_same_alone_and_in_a_batch_of_16(llm):
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 12, (16,), generator=generator)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert len({tuple(r.token_ids) for r in together}) > 8  # the requests really differ
    for prompt, result in zip(prompts, together):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == result.token_ids, prompt
