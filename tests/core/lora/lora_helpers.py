"""Tiny random models, LoRA adapters made by the real `peft` library, and engines that serve them.

Each adapter is PEFT's own: get_peft_model over the tiny base, every LoRA matrix randomised (PEFT
starts lora_B, and an embedding's lora_embedding_A, at zero), save_pretrained. Its reference is
PEFT's merge_and_unload() model under transformers."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from switchyard.core.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.lora.targets import peft_target
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.lora_adapters import fill_lora_weights

BLOCK_SIZE = 4
ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=95, bos_token_id=1, tie_word_embeddings=False)
    values.update(overrides)
    return LlamaConfig(**values)


def save_base(config, path, tokenizer, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than default weights, so a wrong delta shows
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def load_base(base_dir: str):
    """The base under transformers, its weights copied out of the file's mapping: an engine built
    later in this process drops the pages of mapped weight files (core/memory.py), which would
    put a merged model's weights back to the file's."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


def make_adapter(base_dir: str, path, seed: int, r: int = 4, alpha: int = 8, targets=None, scale: float = 0.3,
                 **lora_options):
    """A PEFT adapter over the base at `path`; returns PEFT's merged model (the reference)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_model = get_peft_model(load_base(base_dir), PeftLoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets or ATTENTION_AND_MLP, lora_dropout=0.0, **lora_options))
    fill_lora_weights(peft_model, seed, scale)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()


def make_engine(base_dir: str, adapters=(), max_loras: int = 4, max_lora_rank: int = 8,
                num_blocks: int | None = 96, enable: bool = True, budget: int = 2048,
                kv_cache_memory: int | None = None, **engine_options) -> EngineCore:
    config = EngineConfig(model=engine_options.pop("model", None) or ModelConfig(model=base_dir),
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                            kv_cache_memory=kv_cache_memory),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                          lora=LoraConfig(adapters=tuple((n, str(p)) for n, p in adapters), enable=enable,
                                          max_loras=max_loras, max_lora_rank=max_lora_rank),
                          backend="cpu", **engine_options)
    return EngineCore(config)  # the CPU backend, its LoRA kernel (backends/cpu/lora.py)


class LogitsRecorder:
    """Records every step's sampled logits rows, by request id (the runner's execute, wrapped)."""

    def __init__(self, engine: EngineCore):
        self.rows: dict[str, list[torch.Tensor]] = {}
        execute = engine.runner.execute

        def recording(scheduler_output):
            logits, request_ids = execute(scheduler_output)
            for i, rid in enumerate(request_ids):
                self.rows.setdefault(rid, []).append(logits[i].clone())
            return logits, request_ids

        engine.runner.execute = recording


def run(engine: EngineCore, requests: list[tuple[str, list[int], str | None]], params: SamplingParams = GREEDY,
        on_step=None) -> dict[str, list[int]]:
    """(request id, prompt, adapter) each, added together; the tokens of every request that
    produced some until the engine had no more work (those added before too)."""
    for rid, prompt, adapter in requests:
        engine.add_request(Request(rid, list(prompt), params, lora_name=adapter))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step is not None:
            on_step(engine)
    return tokens


@torch.inference_mode()
def reference_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits of each position that produced one of `tokens` (the last prompt
    position, then each generated token but the last)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    return hf(ids).logits[0, len(prompt) - 1:].float()


@torch.inference_mode()
def reference_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False,
                      min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(vocab_size: int = 96, count: int = 3, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size - 1, (n,), generator=generator).tolist() for n in (9, 14, 5, 11, 7)[:count]]


def add_deltas_by_hooks(core: EngineCore, adapter_dir, scale: float) -> None:
    """Each targeted projection's output gets scale * (x @ A.T) @ B.T on its columns (plain torch)."""
    from safetensors.torch import load_file

    tensors = load_file(f"{adapter_dir}/adapter_model.safetensors")
    model = core.loaded.model
    for name in tensors:
        if not name.endswith("lora_A.weight"):
            continue
        peft_module = name.removesuffix(".lora_A.weight")
        a, b = tensors[name], tensors[peft_module + ".lora_B.weight"]
        module_path, part = peft_target(peft_module)
        module = model.get_submodule(module_path)
        start = _part_start(core, module_path, part)

        def hook(mod, inputs, out, a=a, b=b, start=start):
            out = out.clone()
            out[:, start:start + b.shape[0]] += scale * (inputs[0].float() @ a.t()) @ b.t()
            return out

        module.register_forward_hook(hook)


def _part_start(core: EngineCore, module_path: str, part: int) -> int:
    config = core.loaded.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    if module_path.endswith("qkv_proj"):
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return (0, q, q + kv)[part]
    if module_path.endswith("gate_up_proj"):
        return part * config.intermediate_size
    return 0
