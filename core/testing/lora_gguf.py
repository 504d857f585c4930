"""A PEFT LoRA adapter written as llama.cpp's LoRA GGUF file, without llama.cpp's converter (absent
on CI), for tests and benchmarks.

`write_gguf_adapter` follows convert_lora_to_gguf.py's layout by hand: llama.cpp's tensor names
(written out here, independent of the reader's table, core/lora/gguf_adapter.py), token_embd's
transposed lora_a, and the q/k lora_b rows permuted as convert_hf_to_gguf's LlamaModel.permute
does. Llama-architecture models only."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

# llama.cpp's names of the Hugging Face modules (gguf-py's tensor table, written out here by hand)
LLAMA_CPP = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute (n_head: the heads of q, or of k)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama_cpp_name(module: str) -> str:
    if module == "model.embed_tokens":
        return "token_embd.weight"
    if module == "lm_head":
        return "output.weight"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{LLAMA_CPP[rest]}.weight"


def peft_pairs(peft_dir) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Hugging Face module -> (A, B) of a PEFT adapter."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    pairs = {}
    for name, a in tensors.items():
        for a_name, b_name in ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B")):
            if name.endswith(a_name):
                module = name.removesuffix(a_name).removeprefix("base_model.model.")
                pairs[module] = (a, tensors[name.removesuffix(a_name) + b_name])
    return pairs


def stored(tensor: torch.Tensor, tensor_type: str):
    """(data, raw dtype) of a tensor written as `tensor_type`; as the converter does, F16 where the
    type's blocks do not divide its rows (Q8_0's 32 values)."""
    import gguf

    values = tensor.contiguous().numpy().astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if qtype == gguf.GGMLQuantizationType.F32:
        return values, None
    if qtype == gguf.GGMLQuantizationType.F16 or values.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return values.astype(np.float16), None
    return gguf.quants.quantize(values, qtype), qtype


def write_gguf_adapter(peft_dir, path, hf_config, *, tensor_type: str = "F32", header: dict | None = None,
                       rename: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    """The PEFT adapter at `peft_dir` written to `path` as convert_lora_to_gguf.py writes it, for a
    base of config `hf_config` (its head counts: the q/k permutation). `header` replaces or (with
    None) removes metadata; `rename` and `drop` spoil tensor names, for the refusals."""
    import gguf

    with open(os.path.join(peft_dir, "adapter_config.json")) as file:
        alpha = json.load(file)["lora_alpha"]
    fields = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float(alpha)}
    fields.update(header or {})
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_float32(key, value)
    for module, (a, b) in sorted(peft_pairs(peft_dir).items()):
        if module.endswith("q_proj"):
            b = llama_cpp_permute(b, hf_config.num_attention_heads)
        elif module.endswith("k_proj"):
            b = llama_cpp_permute(b, hf_config.num_key_value_heads)
        if module.endswith("embed_tokens"):
            a = a.t()
        name = llama_cpp_name(module)
        for suffix, tensor in ((".lora_a", a), (".lora_b", b)):
            full = (rename or {}).get(name + suffix, name + suffix)
            if full not in drop:
                data, raw_dtype = stored(tensor, tensor_type)
                writer.add_tensor(full, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def default_model_gguf_adapter(peft_dir, path, **options) -> str:
    """The PEFT adapter at `peft_dir`, made over the default model's shapes
    (lora_adapters.default_model_adapter), written as llama.cpp's LoRA GGUF file at `path`
    (`options`: write_gguf_adapter's)."""
    from ..config import ModelConfig
    from ..loader import choose_model
    from ..models.plain_config import transformers_config

    return write_gguf_adapter(peft_dir, path, transformers_config(choose_model(ModelConfig())[1]), **options)
