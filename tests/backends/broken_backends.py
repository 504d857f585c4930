"""Backends that each break exactly one thing the contract suite (core/testing/backend_contract.py)
checks: the CPU backend over a given attention kernel (`KernelBackend`), with one hook or
declaration gone wrong. tests/backends/test_backend_contract.py maps every check of the suite
to the one here it must reject, and to the same backend keeping the contract."""
from __future__ import annotations

from dataclasses import replace

import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.runner import CpuModelRunner
from switchyard.core.backend import KV_SCALE_BYTES, ProbeResult
from switchyard.core.kv.quantized import is_quantized
from switchyard.core.lora.kernel import TorchLoraKernel
from switchyard.core.ops.attention import ReferenceAttentionKernel


# -- kernels --------------------------------------------------------------------------------------
class OffKernel(ReferenceAttentionKernel):
    """1% off the reference; its write_kv also writes one slot too far."""

    def write_kv(self, key, value, kv_cache, meta) -> None:
        super().write_kv(key, value, kv_cache, replace(meta, slot_mapping=meta.slot_mapping + 1))

    def forward(self, query, kv_cache, meta):
        return super().forward(query, kv_cache, meta) * 1.01


class LyingKernel(ReferenceAttentionKernel):
    graph_safe = True  # but it reads the metadata's host tuples


class ScalelessKvKernel(ReferenceAttentionKernel):
    """Writes a quantized KV cache's codes but leaves every row's scale at 1: its values read back
    as the bare codes."""

    def write_kv(self, key, value, kv_cache, meta) -> None:
        super().write_kv(key, value, kv_cache, meta)
        if is_quantized(kv_cache):
            rows = kv_cache.view(torch.uint8).flatten(1, 2)[:, meta.slot_mapping.long()]
            rows[..., -KV_SCALE_BYTES:] = torch.ones(1).view(torch.uint8)
            kv_cache.view(torch.uint8).flatten(1, 2)[:, meta.slot_mapping.long()] = rows


class AnchorBlindKernel(ReferenceAttentionKernel):
    """Behind a backend that declares window anchors, but counts every window back from seq_len - 1."""

    def forward(self, query, kv_cache, meta):
        return super().forward(query, kv_cache, replace(meta, window_anchors=None, window_anchors_cpu=None))


class KernelBackend(CpuBackend):
    """The CPU backend over the given kernel (the reference one: the backend keeping the contract)."""

    def __init__(self, kernel=ReferenceAttentionKernel):
        super().__init__(pack_weights=False)
        self._kernel = kernel

    def attention(self, spec):
        return self._kernel(spec)


class UnscaledLoraKernel(TorchLoraKernel):
    """Forgets the adapters' scales (alpha / rank): every delta at scale 1."""

    def expand(self, y, h, b, scales, batch) -> None:
        super().expand(y, h, b, torch.ones_like(scales), batch)


class BatchDependentLoraKernel(TorchLoraKernel):
    """Sums `in` in two halves when the step has more than one token: the same values within
    float rounding, but a token's bits depend on what shares its step."""

    def shrink(self, x, a, batch):
        if x.shape[0] <= 1:
            return super().shrink(x, a, batch)
        half = x.shape[1] // 2
        return super().shrink(x[:, :half], a[:, :, :half], batch) + super().shrink(x[:, half:], a[:, :, half:], batch)


class LoraKernelBackend(CpuBackend):
    """The CPU backend over the given LoRA kernel (its own C++ one keeps the contract)."""

    def __init__(self, kernel) -> None:
        super().__init__(pack_weights=False)
        self._lora_override = kernel

    def lora_kernel(self):
        return self._lora_override


# -- one hook or declaration broken each ------------------------------------------------------------
class RaisingProbe(KernelBackend):
    """probe() raises where it must report an unusable backend."""

    @classmethod
    def probe(cls) -> ProbeResult:
        raise RuntimeError("no device driver")


class MisspelledDtype(KernelBackend):
    """Declares a dtype under a name the engine does not know ("fp16" for "float16")."""

    def capabilities(self):
        return replace(super().capabilities(), dtypes=("float32", "fp16"))


class DeviceName(KernelBackend):
    """Its device is the device's name, not a torch.device."""

    @property
    def device(self):
        return "cpu"


class SharedKvCache(KernelBackend):
    """Every layer's KV cache is the same tensor."""

    def allocate_kv_cache(self, num_layers, num_blocks, spec):
        return super().allocate_kv_cache(1, num_blocks, spec) * num_layers


class NegatedHead(KernelBackend):
    """prepare_model also negates the LM head (a repacking that went wrong)."""

    def prepare_model(self, loaded, config) -> None:
        super().prepare_model(loaded, config)
        with torch.no_grad():
            loaded.model.lm_head.weight.neg_()


class LastRowLogitsRunner(CpuModelRunner):
    """Gives every row of a verifying request the logits of its last row: logits computed once
    per request, as for a plain decode, and repeated."""

    def execute(self, scheduler_output):
        logits, ids = super().execute(scheduler_output)
        rows = {s.request_id: s.num_logits for s in scheduler_output.scheduled}
        counts = torch.tensor([rows[request_id] for request_id in ids], device=logits.device)
        return logits[counts.cumsum(0) - 1].repeat_interleave(counts, dim=0), ids


class VerifyOnLastRow(KernelBackend):
    """Declares multi-token decode queries, but its runner scores only a verify's last row."""

    def make_runner(self, loaded, kv_caches, config):
        return LastRowLogitsRunner(loaded.model, self, kv_caches, config.cache.block_size)


class ImageBlindRunner(CpuModelRunner):
    """Runs a step with image tokens as a text step: the image placeholders' own embeddings."""

    def forward_images(self, scheduler_output, step):
        return self.forward(step)


class ImageBlind(KernelBackend):
    """Declares vision encoders (as the CPU does), but its runner never writes the images in."""

    def make_runner(self, loaded, kv_caches, config):
        return ImageBlindRunner(loaded.model, self, kv_caches, config.cache.block_size)


class OneKvBlock(KernelBackend):
    """Sizes its KV cache with no floor: one block, where block 0 is reserved."""

    def num_kv_blocks(self, bytes_per_block, cache) -> int:
        return 1


class LocalCommunicator:
    """Collectives over one process: each returns its tensor."""

    def all_reduce(self, tensor):
        return tensor

    def all_gather(self, tensor, dim=-1):
        return tensor

    def broadcast(self, tensor, src=0):
        return tensor


class AlwaysCommunicator(KernelBackend):
    """Returns a communicator unsharded too, where the engine reads None as "not sharded"."""

    def communicator(self):
        return LocalCommunicator()


class LoraWithoutKernel(KernelBackend):
    """Declares LoRA (Capabilities.lora) but has no kernel for it."""

    def lora_kernel(self):
        return None


class NoLauncher(KernelBackend):
    """Declares a dist_backend (gloo) but launches no shards."""

    def shard_launcher(self):
        return None
