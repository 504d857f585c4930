"""Tiny random Llama models saved from configs (no downloads) and an EngineCore driver, for the
speculative decoding tests with grammars and draft models."""
from __future__ import annotations

import torch

from switchyard.core.config import (CacheConfig, EngineConfig, GrammarConfig, ModelConfig, SchedulerConfig,
                                    SpeculativeConfig)
from switchyard.core.engine.core import EngineCore
from switchyard.core.scheduling.request import FinishReason, Request


def save_tiny_llama(path, tokenizer, vocab_size=96, seed=0, num_layers=2, eos_token_id=95, perturb=None) -> str:
    """A random tiny Llama saved at `path` with `tokenizer`. `perturb`: (a saved model's
    directory, scale): that model's weights plus Gaussian noise of `scale` times each weight's
    standard deviation instead (a draft that agrees with it often, not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=eos_token_id, bos_token_id=1)
    model = LlamaForCausalLM(config)
    if perturb is not None:
        source, scale = perturb
        model = LlamaForCausalLM.from_pretrained(source)
        with torch.no_grad():
            for weight in model.parameters():
                weight.add_(torch.randn_like(weight) * weight.std() * scale)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def make_engine(model_dir, speculate=0, draft=None, num_blocks=128, draft_blocks=None, block_size=4, budget=2048,
                prefix_caching=True, adaptive=False, grammar_backend="xgrammar") -> EngineCore:
    speculative = SpeculativeConfig(num_speculative_tokens=speculate, adaptive=adaptive,
                                    method="draft" if draft else "ngram", draft_model=draft,
                                    draft_num_blocks=draft_blocks)
    return EngineCore(EngineConfig(
        model=ModelConfig(model=model_dir),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        grammar=GrammarConfig(backend=grammar_backend, use_processes=False),
        speculative=speculative, backend="cpu"))


def run(engine, prompts, params, abort_after=None):
    """Steps until done: ({id: tokens}, {id: logprobs}, {id: finish reason}, steps)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(Request(f"r{i}", list(prompt), p))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}
    reasons = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].extend(out.new_token_ids)
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                logprobs[out.request_id].extend(out.logprobs)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if abort_after and steps == abort_after[1]:
            engine.finish_request(abort_after[0], FinishReason.ABORT)
    return outputs, logprobs, reasons, steps


def free_blocks(engine) -> int:
    return engine.scheduler.kv_cache_manager.num_free_blocks


def draft_free_blocks(engine) -> int:
    return engine.scheduler.speculator.proposer.kv_cache_manager.num_free_blocks
