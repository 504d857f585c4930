"""Random LoRA steps for kernel tests (core/backend_contract.py LoraKernel), as the engine lays them
out: runs of tokens with one adapter slot (a request's tokens are contiguous) between tokens of
the base model (slot -1); adapters of several ranks zero-padded to the stacks' R; the output a
column slice of a wider tensor (a fused projection's part, its rows strided). No pytest here."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..backend import LoraBatch, LoraKernel
from ..lora.kernel import TorchLoraKernel


def lora_batch(runs: list[tuple[int, int]], device: torch.device | str = "cpu") -> LoraBatch:
    """The batch of (token count, slot) runs, in token order (slot -1: the base model)."""
    slots, segments, start = [], [], 0
    for count, slot in runs:
        slots += [slot] * count
        if slot >= 0 and count:
            segments.append((start, start + count, slot))
        start += count
    return LoraBatch(torch.tensor(slots, dtype=torch.int32, device=device), tuple(segments))


@dataclass(frozen=True)
class LoraStep:
    """One projection's operands: x [T, in], the stacks a [S, R, in] and b [S, out, R], scales [S],
    and `wide` [T, out + 2 * margin], whose columns [margin, margin + out) are the y expanded into."""

    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scales: torch.Tensor
    batch: LoraBatch
    wide: torch.Tensor
    margin: int

    @property
    def out_features(self) -> int:
        return self.b.shape[1]

    def run(self, kernel: LoraKernel) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, the wide output after expand) of `kernel`, on copies of the operands (on the host)."""
        wide = self.wide.clone()
        h = kernel.shrink(self.x.clone(), self.a, self.batch)
        kernel.expand(wide[:, self.margin:self.margin + self.out_features], h, self.b, self.scales, self.batch)
        return h.cpu(), wide.cpu()

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(TorchLoraKernel())

    def token(self, t: int) -> LoraStep:
        """The step of token t alone."""
        slot = int(self.batch.token_slots[t])
        batch = lora_batch([(1, slot)], self.x.device)
        return LoraStep(self.x[t:t + 1].clone(), self.a, self.b, self.scales, batch, self.wide[t:t + 1].clone(),
                        self.margin)


def random_runs(rng: random.Random, slots: int, tokens: int) -> list[tuple[int, int]]:
    """Runs of 1..6 tokens (a decode, a verify, a prompt chunk) of random slots, -1 among them,
    until `tokens` tokens."""
    runs, total = [], 0
    while total < tokens:
        count = min(tokens - total, rng.choice([1, 1, 2, 3, 6]))
        runs.append((count, rng.randrange(-1, slots)))
        total += count
    return runs


def random_lora_step(seed: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     tokens: int = 24, in_features: int = 72, out_features: int = 40, slots: int = 4,
                     rank: int = 16, runs: list[tuple[int, int]] | None = None) -> LoraStep:
    """A step of `tokens` tokens over `slots` adapters whose ranks (1..rank) are zero-padded to
    `rank`; values scaled so that h and the deltas are about 1 (tolerances are then absolute)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    runs = random_runs(rng, slots, tokens) if runs is None else runs
    tokens = sum(count for count, _ in runs)
    a = torch.randn(slots, rank, in_features, generator=generator) / in_features ** 0.5
    b = torch.randn(slots, out_features, rank, generator=generator) / rank ** 0.5
    for slot in range(slots):  # each adapter's own rank, the rest padding
        own = rng.randint(1, rank)
        a[slot, own:] = 0
        b[slot, :, own:] = 0
    scales = torch.rand(slots, generator=generator) * 2
    margin = 3
    wide = torch.randn(tokens, out_features + 2 * margin, generator=generator)
    x = torch.randn(tokens, in_features, generator=generator)
    return LoraStep(x.to(dtype=dtype, device=device), a.to(dtype=dtype, device=device),
                    b.to(dtype=dtype, device=device), scales.to(device), lora_batch(runs, device),
                    wide.to(dtype=dtype, device=device), margin)
