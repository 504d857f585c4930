"""Tiny pre-quantized Hub checkpoints, built offline, and their independent float references.

A tiny random Llama (transformers) is saved with its decoder linears replaced by a quantized
layout; the reference is a copy of the same transformers model whose linears hold the float
weights the quantized tensors stand for, computed here by plain math (or by the tool itself,
where the tool is installed), never by the reader under test.

- GPTQ and AWQ: written by core/testing/hub_layers.py's round-to-nearest packers from the
  documented layouts (GPTQ v1 / v2 zero points, AWQ's GEMM layout). gptqmodel itself needs torch
  >= 2.14.1 and would replace the pinned torch, so the project does not install it;
  test_hub_quant.py's gptqmodel test runs where it is installed (a side environment). AutoAWQ
  is GPU-only and deprecated.
- compressed-tensors: the real compressor (compressed_tensors' ModelCompressor, as llm-compressor
  saves), scales and zero points from its own calculate_qparams (min-max, as llm-compressor's
  RTN QuantizationModifier), scales rounded to bf16 as a bf16 model's are; the reference is its own
  decompression (PackedQuantizationCompressor).
"""
from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from model_helpers import make_hf

from switchyard.core.testing.hub_layers import AWQ_CONFIG, awq_pack, gptq_config, gptq_pack

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2)


def quantized_linears(hf) -> dict[str, torch.Tensor]:
    """HF layer prefix -> float weight [out, in] of each decoder linear."""
    return {name: module.weight.detach().float().clone() for name, module in hf.named_modules()
            if name.rsplit(".", 1)[-1] in QUANTIZED}


def with_positive_group(w: torch.Tensor, group: int) -> torch.Tensor:
    """w with row 0's first group all positive: an asymmetric zero point of 0 (its v1 form
    borrows from the next value of the packed word)."""
    w = w.clone()
    w[0, :group if group > 0 else w.shape[1]] = w[0, :group if group > 0 else w.shape[1]].abs() + 0.01
    return w


def write_checkpoint(path, hf, layers: dict[str, dict[str, torch.Tensor]], quantization_config: dict) -> None:
    """hf saved under `path` with each layer prefix's `.weight` replaced by its quantized tensors."""
    hf.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for prefix, parts in layers.items():
        del tensors[prefix + ".weight"]
        tensors.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in parts.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def reference_model(hf, weights: dict[str, torch.Tensor]):
    """A copy of hf whose linears hold `weights` (layer prefix -> float [out, in])."""
    ref = copy.deepcopy(hf)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for prefix, weight in weights.items():
            modules[prefix].weight.copy_(weight)
    return ref


def build_packed(path, kind: str, **options):
    """(reference model, checkpoint written under path) for kind "gptq" (bits, group, act_order,
    sym, v1) or "awq" (group)."""
    hf = make_hf(tiny_config(), seed=3)
    layers, references = {}, {}
    inputs: dict[str, int] = {}  # the linears of one input share GPTQ's act-order (one Hessian)
    for prefix, w in quantized_linears(hf).items():
        shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        i = inputs.setdefault(shared, len(inputs))
        group = options["group"]
        w = with_positive_group(w, group) if not options.get("sym", False) else w
        if kind == "gptq":
            layers[prefix], references[prefix] = gptq_pack(w, options["bits"], group, options["act_order"],
                                                           options["sym"], options["v1"], seed=i)
        else:
            layers[prefix], references[prefix] = awq_pack(w, group, seed=i)
    config = (gptq_config(options["bits"], options["group"], options["act_order"], options["sym"], options["v1"])
              if kind == "gptq" else {**AWQ_CONFIG, "group_size": options["group"]})
    write_checkpoint(path, hf, layers, config)
    return reference_model(hf, references)


def build_compressed(path, num_bits: int, strategy: str, group: int | None, symmetric: bool):
    """A compressed-tensors checkpoint made by compressed_tensors itself, and its reference (the
    same tensors decompressed by compressed_tensors)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    hf = make_hf(tiny_config(), seed=4)
    floats = copy.deepcopy(hf)
    args = QuantizationArgs(num_bits=num_bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for _, module in hf.named_modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                grouped = w.reshape(w.shape[0], -1, group if strategy == "group" else w.shape[1])
                scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
                module.weight_scale.copy_(scale.bfloat16())  # as llm-compressor writes a bf16 model's
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path)
    compressor.update_config(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    references = {}
    for prefix in quantized_linears(floats):
        state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        references[prefix] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
    return reference_model(floats, references)
