"""Shared by test_bnb_quant.py and test_fp8_quant.py: a tiny random Llama saved as a float
checkpoint, the CPU backend's model of a checkpoint (kernels swapped in), a chunked ragged batch
run in two steps, greedy decoding of several requests together, and transformers' side of each."""
from __future__ import annotations

import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.core.backend import AttentionMetadata
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.loader import load_model

BLOCK_SIZE = 4
# Three requests: A whole then one decode, B's prompt in two chunks, C whole (step 1: A, B[:5], C;
# step 2: A's decode next to B[5:]).
PROMPTS = {"A": [1, 5, 9, 30, 200, 7, 8], "B": [3, 44, 91, 17, 250, 6, 6, 120, 33, 2, 71], "C": [40, 41, 42]}
DECODE_TOKEN = 11


def tiny_llama(hidden: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)


def save_float(config, path, seed: int = 1):
    """A random float32 model of `config` (weights 0.1 * N(0, 1), norms around 1), saved under `path`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def cpu_model(path, quantize: str | None = None, dtype: str = "float32"):
    """(the loaded model with the CPU backend's kernels swapped in, the method it is served in)."""
    backend = CpuBackend()
    config = EngineConfig(model=ModelConfig(model=str(path), quantize=quantize, dtype=dtype),
                          cache=CacheConfig(num_blocks=16))
    config = check_capabilities("cpu", backend.capabilities(), config)
    loaded = load_model(config.model, backend, block_size=BLOCK_SIZE)
    backend.prepare_model(loaded, config)
    return loaded, config.model.quantize


def module_kinds(loaded) -> set[str]:
    return {type(m).__name__ for m in loaded.model.modules()}


def _step(loaded, kv, chunks):
    """chunks: (new token ids, tokens already cached, block ids); decodes first. Logits per chunk."""
    ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for tokens, cached, blocks in chunks:
        for offset, token in enumerate(tokens):
            pos = cached + offset
            ids.append(token)
            positions.append(pos)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(len(ids))
        seq_lens.append(cached + len(tokens))
    width = max(len(b) for _, _, b in chunks)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([b + [0] * (width - len(b)) for _, _, b in chunks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=sum(1 for t, _, _ in chunks if len(t) == 1), max_query_len=max(len(t) for t, _, _ in chunks),
        max_seq_len=max(seq_lens), query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens))
    with torch.inference_mode():
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.tensor(positions), kv, meta))
    return list(logits.float().split([len(t) for t, _, _ in chunks]))


def two_steps(loaded) -> dict[str, torch.Tensor]:
    """Logits of PROMPTS as a chunked ragged batch in two steps (A's include its decode token)."""
    a, b, c = PROMPTS["A"], PROMPTS["B"], PROMPTS["C"]
    blocks = {"A": [5, 1], "B": [2, 7, 3], "C": [6]}
    kv = CpuBackend().allocate_kv_cache(loaded.num_layers, 10, loaded.attention_spec)
    la, lb1, lc = _step(loaded, kv, [(a, 0, blocks["A"]), (b[:5], 0, blocks["B"]), (c, 0, blocks["C"])])
    la2, lb2 = _step(loaded, kv, [([DECODE_TOKEN], len(a), blocks["A"]), (b[5:], 5, blocks["B"])])
    return {"A": torch.cat([la, la2]), "B": torch.cat([lb1, lb2]), "C": lc}


def hf_logits(hf) -> dict[str, torch.Tensor]:
    """transformers' logits of each whole sequence of two_steps."""
    out = {}
    for key, ids in PROMPTS.items():
        ids = ids + [DECODE_TOKEN] if key == "A" else ids
        with torch.no_grad():
            out[key] = hf(torch.tensor([ids])).logits[0].float()
    return out


def greedy_ours(loaded, num_tokens: int) -> list[list[int]]:
    """Greedy continuations of PROMPTS decoded together, one token per request a step."""
    prompts = list(PROMPTS.values())
    each = -(-(max(map(len, prompts)) + num_tokens) // BLOCK_SIZE)
    kv = CpuBackend().allocate_kv_cache(loaded.num_layers, 1 + each * len(prompts), loaded.attention_spec)
    blocks = [list(range(1 + i * each, 1 + (i + 1) * each)) for i in range(len(prompts))]
    chunks = [(p, 0, b) for p, b in zip(prompts, blocks)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(num_tokens):
        for i, rows in enumerate(_step(loaded, kv, chunks)):
            outputs[i].append(int(rows[-1].argmax()))
        chunks = [([out[-1]], len(p) + len(out) - 1, b) for p, out, b in zip(prompts, outputs, blocks)]
    return outputs


def greedy_hf(hf, num_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS.values():
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def assert_close_logits(ours: dict, expected: dict, rel: float, exact_argmax: bool = True,
                        min_agreement: float = 0.9) -> None:
    """Every position's logits within rel * the largest |logit|, and the same argmax (or, where
    near-ties may swap, the same argmax at min_agreement of the positions)."""
    scale = max(e.abs().max().item() for e in expected.values())
    worst = max((ours[k] - expected[k]).abs().max().item() for k in PROMPTS) / scale
    print(f"logits: max |diff| {worst:.4f} of the largest |logit| ({scale:.3g})")
    for key in PROMPTS:
        assert ours[key].shape == expected[key].shape
        diff = (ours[key] - expected[key]).abs().max().item()
        assert diff <= rel * scale, f"request {key}: max |diff| {diff:.4g} over {rel} * {scale:.3g}"
        if exact_argmax:
            assert torch.equal(ours[key].argmax(-1), expected[key].argmax(-1)), f"request {key}: argmax"
    agreement = torch.cat([ours[k].argmax(-1) == expected[k].argmax(-1) for k in PROMPTS]).float().mean().item()
    assert agreement >= min_agreement, f"argmax agreement {agreement:.2f}"


def with_weights(hf, weights: dict[str, torch.Tensor]):
    """`hf` with its linear weights replaced (name -> float [out, in]): the dequantized reference."""
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, weight in weights.items():
            params[name].copy_(weight.to(params[name].dtype))
    return hf
