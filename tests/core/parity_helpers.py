"""Architecture parity with transformers, shared by the tests of each native model
family: a tiny random-weight Hugging Face model is saved as safetensors, loaded through
`load_model`, and compared on the ragged chunked batch of model_helpers.run_two_steps
(logits) and on 32 greedy tokens decoded step by step through the paged KV cache."""
from __future__ import annotations

import pytest
import torch
from model_helpers import Chunk, ReferenceBackend, run_step, run_two_steps, save_tiny  # noqa: F401 - re-exported

from switchyard.core.config import ModelConfig
from switchyard.core.loader import load_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded machine torch's
    thread pool made each step 400x slower (1.4 s instead of 3 ms); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_ours(path, **model_config):
    return load_model(ModelConfig(model=str(path), **model_config), ReferenceBackend(), BLOCK_SIZE)


def prompts(vocab_size: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(7)
    return {key: torch.randint(0, vocab_size, (n,), generator=generator).tolist() for key, n in
            (("A", 7), ("B", 10), ("C", 3))}


def assert_logits_match(loaded, hf, label: str, atol: float = 1e-4) -> None:
    """Our logits of a chunked ragged batch (plus one decode) against transformers' full forward."""
    decode_token = 11
    ours = run_two_steps(loaded, prompts(loaded.vocab_size), decode_token, BLOCK_SIZE)
    for key, ids in prompts(loaded.vocab_size).items():
        if key == "A":
            ids = ids + [decode_token]
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        assert ours[key].shape == expected.shape
        torch.testing.assert_close(ours[key], expected, atol=atol, rtol=atol, msg=f"{label} request {key}")


def greedy_ours(loaded, prompt_lists: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations of several prompts decoded together, one token per request a step."""
    blocks_each = -(-(max(map(len, prompt_lists)) + num_tokens) // BLOCK_SIZE)
    kv_caches = ReferenceBackend().allocate_kv_cache(loaded.num_layers, 1 + blocks_each * len(prompt_lists),
                                                     loaded.attention_spec)
    block_ids = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(len(prompt_lists))]
    chunks = [Chunk(list(p), 0, ids) for p, ids in zip(prompt_lists, block_ids)]
    outputs: list[list[int]] = [[] for _ in prompt_lists]
    lengths = [len(p) for p in prompt_lists]
    for _ in range(num_tokens):
        logits = run_step(loaded, kv_caches, chunks, BLOCK_SIZE)
        for i, rows in enumerate(logits):
            outputs[i].append(int(rows[-1].argmax()))
        chunks = [Chunk([out[-1]], lengths[i] + len(out) - 1, block_ids[i]) for i, out in enumerate(outputs)]
    return outputs


def greedy_transformers(hf, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def assert_greedy_matches(loaded, hf, num_tokens: int = 32, prompt_lists: list[list[int]] | None = None) -> None:
    """Several prompts decoded together by us; each one alone by transformers' generate."""
    prompt_lists = prompt_lists or list(prompts(loaded.vocab_size).values())
    ours = greedy_ours(loaded, prompt_lists, num_tokens)
    for prompt, tokens in zip(prompt_lists, ours):
        assert tokens == greedy_transformers(hf, prompt, num_tokens), prompt
