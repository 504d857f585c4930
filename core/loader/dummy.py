"""Random ("dummy") weights of a real config, for benchmarks and tests: small
normal values (std 0.02) and unit norm weights, so activations stay finite."""
from __future__ import annotations

import zlib

import torch
from torch import nn

DUMMY_STD = 0.02


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int, per_name: bool = False) -> None:
    """Deterministic in `seed` for a given device type. Parameters on the CPU are drawn
    in float32 from one CPU generator; parameters on an accelerator are drawn there, in
    their own dtype, from one generator of that device (an 8B model fills in a second
    instead of minutes of host drawing and copying), so CPU and GPU values differ.
    per_name (tensor-parallel shards): one generator per parameter, seeded from its name,
    so a replicated parameter gets the same values on every shard."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        # XLA devices have no torch.Generator: drawn on the host, like the CPU's values
        device = torch.device("cpu") if param.device.type == "xla" else param.device
        if per_name:
            name_seed = seed * 1_000_003 + zlib.crc32(name.encode())
            generators[device] = torch.Generator(device=device).manual_seed(name_seed)
        elif device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if device.type == "cpu":
            values = torch.randn(param.shape, generator=generators[device], dtype=torch.float32,
                                 device=device) * DUMMY_STD
            param.data.copy_(values)
        else:
            param.data.normal_(0.0, DUMMY_STD, generator=generators[device])
