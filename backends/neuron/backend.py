"""AWS Neuron backend: the XLA static-shape runner (backends/tpu) on NeuronCores.

torch-neuronx is torch_xla with a Neuron PJRT plugin: the device is an XLA device, graphs
are compiled by neuronx-cc per static shape, so the tpu backend's buckets, runner and
XLA gather attention serve it unchanged. What is Neuron's own: the probe (devices,
torch_neuronx, compiler), the persistent compile cache (in the engine process's environment,
process_environment), and NEURON_RT_VISIBLE_CORES per shard.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from switchyard.backends.tpu.attention import XlaAttentionKernel
from switchyard.backends.tpu.backend import XLA_ATTENTION_IMPL, TpuBackend
from switchyard.core.backend import AttentionKernel, AttentionSpec, Capabilities, ProbeResult, ShardInfo

from .device import NeuronHost, NeuronProbe
from .env import COMPILE_CACHE_VAR, compile_cache_url, neuron_shard_env

NEURON_ATTENTION_IMPL = XLA_ATTENTION_IMPL.replace("XLA gather attention", "XLA gather attention compiled by neuronx-cc")


class NeuronBackend(TpuBackend):
    name = "neuron"
    priority = 60
    planned_attention_impl = NEURON_ATTENTION_IMPL

    def __init__(self, compile_cache: str | None = None, cores_per_shard: int = 1,
                 host: NeuronHost | None = None) -> None:
        super().__init__()
        self.host = host or NeuronHost()
        self.compile_cache = compile_cache_url(compile_cache, os.environ)
        self.cores_per_shard = cores_per_shard

    @classmethod
    def probe(cls) -> ProbeResult:
        return cls.probe_host(NeuronHost())

    @classmethod
    def probe_host(cls, host: NeuronHost) -> ProbeResult:
        found = NeuronProbe.of(host)
        return ProbeResult(found.usable, found.reason())

    def process_environment(self, config) -> dict[str, str]:
        """The compile cache location, merged with the present environment: neuronx-cc and the
        Neuron runtime read it only from NEURON_COMPILE_CACHE_URL, so the engine process starts
        with it (core/engine/process.py re-executes itself once when it differs; each shard
        process gets it in neuron_shard_env). Asked whatever `config.runtime` says: it is where
        compiled graphs are kept, not a tuning. An engine run inside this process (no engine
        process) leaves the environment as it is, the SDK then keeping its own default."""
        return {**os.environ, COMPILE_CACHE_VAR: self.compile_cache}

    def capabilities(self) -> Capabilities:
        # neuronx-cc handles float32 and bfloat16 graphs; blocks are gathered whole, any size
        return Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(8, 16, 32, 64, 128),
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=True, static_shapes=True,
                            attention_impl=f"{NEURON_ATTENTION_IMPL}; compile cache {self.compile_cache}")

    def available_memory_bytes(self) -> int:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(self.device)
        return int(info["bytes_limit"]) - int(info["bytes_used"])

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return XlaAttentionKernel(spec)  # the Pallas kernel is TPU-only

    def shard_env(self, shard: ShardInfo) -> Mapping[str, str]:
        return neuron_shard_env(shard, self.compile_cache, self.cores_per_shard)
