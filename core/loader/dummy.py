"""Random ("dummy") weights of a real config, for benchmarks and tests: small
normal values (std 0.02) and unit norm weights, so activations stay finite."""
from __future__ import annotations

import torch
from torch import nn

DUMMY_STD = 0.02


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Deterministic in `seed` whatever the device: values are drawn on the CPU."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * DUMMY_STD
            param.data.copy_(values)
