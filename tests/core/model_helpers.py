"""Shared by the model and loader tests: the reference backend (core/testing), flat ragged
batches built by hand, random weights that show mistakes, and the comparisons with
transformers (logits of a ragged chunked batch, greedy generation)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from switchyard.core.backend import AttentionMetadata
from switchyard.core.testing import ReferenceBackend  # noqa: F401 - the model tests' backend, re-exported


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Larger-than-default random weights (and non-unit norms), so mistakes show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm = "norm" in name or ".ln_" in name or "layer_norm" in name
            param.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.15 * noise)


def make_hf(config, seed: int = 1) -> torch.nn.Module:
    """A randomized transformers model of `config` (eager attention, float32, eval)."""
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize(hf, seed)
    return hf


def save_tiny(config, path, seed: int = 1, max_shard_size: str = "1GB") -> torch.nn.Module:
    """make_hf(config), saved as safetensors under `path`; returns the model."""
    hf = make_hf(config, seed)
    hf.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return hf


@dataclass
class Chunk:
    """One request's share of one step."""
    new_token_ids: list[int]
    num_computed_tokens: int  # already in the KV cache
    block_ids: list[int]


def build_step(chunks: list[Chunk], block_size: int):
    """(input_ids [T], positions [T], AttentionMetadata); decodes must come first."""
    input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for chunk in chunks:
        for offset, token_id in enumerate(chunk.new_token_ids):
            pos = chunk.num_computed_tokens + offset
            input_ids.append(token_id)
            positions.append(pos)
            slots.append(chunk.block_ids[pos // block_size] * block_size + pos % block_size)
        starts.append(len(input_ids))
        seq_lens.append(chunk.num_computed_tokens + len(chunk.new_token_ids))
    max_blocks = max(len(c.block_ids) for c in chunks)
    table = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
    num_decodes = 0
    while num_decodes < len(chunks) and len(chunks[num_decodes].new_token_ids) == 1:
        num_decodes += 1
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=num_decodes, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens))
    return torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta


@torch.inference_mode()
def run_step(loaded, kv_caches, chunks: list[Chunk], block_size: int) -> list[torch.Tensor]:
    """Logits of every new token, split per request."""
    input_ids, positions, meta = build_step(chunks, block_size)
    hidden = loaded.model(input_ids, positions, kv_caches, meta)
    assert hidden.dim() == 2 and hidden.shape[0] == len(input_ids)  # width: what the LM head takes
    logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return list(logits.split([len(c.new_token_ids) for c in chunks]))


def run_two_steps(loaded, prompts: dict[str, list[int]], decode_token: int, block_size: int = 4):
    """Step 1: all of A and C, first half of B. Step 2: one decode of A, rest of B.
    Returns {"A": logits of A's prompt + decode token, "B": all of B, "C": all of C}."""
    a, b, c = prompts["A"], prompts["B"], prompts["C"]
    half = len(b) // 2
    blocks = {"A": [5, 1], "B": [2, 7, 3], "C": [6]}
    kv_caches = ReferenceBackend().allocate_kv_cache(loaded.num_layers, 10, loaded.attention_spec)
    la, lb1, lc = run_step(loaded, kv_caches, [Chunk(a, 0, blocks["A"]), Chunk(b[:half], 0, blocks["B"]),
                                               Chunk(c, 0, blocks["C"])], block_size)
    la2, lb2 = run_step(loaded, kv_caches, [Chunk([decode_token], len(a), blocks["A"]),
                                            Chunk(b[half:], half, blocks["B"])], block_size)
    return {"A": torch.cat([la, la2]), "B": torch.cat([lb1, lb2]), "C": lc}


def ragged_prompts(vocab_size: int, lengths: dict[str, int] | None = None, seed: int = 7) -> dict[str, list[int]]:
    """Random prompts A, B, C for run_two_steps (default lengths 7, 10, 3)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = lengths or {"A": 7, "B": 10, "C": 3}
    return {key: torch.randint(0, vocab_size, (n,), generator=generator).tolist() for key, n in lengths.items()}


def assert_two_steps_match(loaded, hf, prompts: dict[str, list[int]], decode_token: int, block_size: int,
                           atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """Our logits of run_two_steps (a ragged batch, B's prompt chunked, A decoding next to
    B's second chunk) against transformers' logits of each whole sequence."""
    ours = run_two_steps(loaded, prompts, decode_token, block_size)
    for key, ids in prompts.items():
        ids = ids + [decode_token] if key == "A" else ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        assert ours[key].shape == expected.shape
        torch.testing.assert_close(ours[key], expected, atol=atol, rtol=rtol, msg=f"request {key}")


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt` (EOS ignored)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                      min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
