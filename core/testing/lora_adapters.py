"""A PEFT LoRA adapter over the default model's shapes, for tests and benchmarks (nothing can be
downloaded, and a LoRA adapter holds only its own matrices): peft's get_peft_model over an
uninitialised copy of the architecture, every LoRA matrix random, save_pretrained."""
from __future__ import annotations

import torch


def default_model_adapter(path, rank: int, targets: list[str], seed: int = 0, scale: float = 0.05,
                          layers: list[int] | None = None) -> None:
    """Writes the adapter to `path`: rank `rank`, alpha 2 x rank, on `targets` (of `layers`, None:
    every layer), its matrices N(0, scale^2) from `seed`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from ..config import ModelConfig
    from ..loader import choose_model
    from ..models.plain_config import transformers_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(choose_model(ModelConfig())[1]),
                                                 dtype=torch.float32)
    peft_model = get_peft_model(model, PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      layers_to_transform=layers, lora_dropout=0.0))
    peft_model.to_empty(device="cpu")
    fill_lora_weights(peft_model, seed, scale)
    peft_model.save_pretrained(str(path))


def fill_lora_weights(peft_model, seed: int, scale: float) -> None:
    """Every LoRA matrix of a PEFT model drawn from N(0, scale^2) (PEFT starts B at zero, which
    would make the adapter a no-op)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
