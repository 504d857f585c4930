"""The embedded default backend: always usable, plain torch on the host CPU."""
from __future__ import annotations

import os

import logging

import torch

from switchyard.core.backend import (SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult,
                                     ShardInfo)
from switchyard.core.shards.process_group import ProcessGroupShards
from switchyard.core.config import CacheConfig
from switchyard.core.kv.sizing import KVCacheSize, blocks_from_configuration, check_fits
from switchyard.core.layers import Linear
from switchyard.core.quant.methods import served_by

from .attention import CpuAttentionKernel, StepPlanCache
from .compiled import CompiledDecodeRunner, CompileOptions, compile_sizes
from .compiled import describe as describe_compiled
from .extension import PagedDecode, isa_levels, level_flags, resolve_isa
from .fused_decode import FusedDecodeRunner, fused_program, load_decode_layers
from .runner import CpuModelRunner
from .fused_decode import describe as describe_fused
from .linear import describe as describe_linears
from .pages import small_pages
from .linear import load_rows_kernel, pack_linears, packable_dtypes, packing_supported, rows_kernel_rows
from .lora import CpuLoraKernel
from .quant import BlockLinear, linear_weights, load_block_kernel, pack_quantized, resolve_activations
from .runtime import cpu_flags, loaded_libraries, prefers_bfloat16, this_machine
from .tuning import choose_single_row_products

logger = logging.getLogger(__name__)

# The in-place kernel takes every decode step (no cap: None). The old cap of 4 came from a
# build that ran on one thread (no -fopenmp, see extension.py). Measured 2026-12-01 on a
# 2-core AVX-512 Xeon shared with other jobs, whole decode step of the default model
# (benchmarks/cpu_decode_step.py, gather and in place interleaved, best round): bfloat16, 64
# decodes of ~256 tokens, in place / gather 0.15; one layer (benchmarks/cpu_decode_attention.py,
# one thread, interleaved minima): 1.8x to 4.8x faster at 1..64 decodes, 256 and 1024 tokens,
# float32 and bfloat16.
IN_PLACE_MAX_DECODES = None

# torch's int4/int8 kernels take batches of more rows than this through a bf16 oneDNN copy (the
# block kernel multiplies any number of rows in integers).
QUANTIZED_BATCH_ROWS = 16

GATHER_IMPL = ("SDPA over gathered blocks (torch scaled_dot_product_attention; decodes in groups of 16, "
               "short bf16 ones as one batched matmul; one call per prompt chunk of a float model: a model with "
               "block-format weights attends every prompt token as a decode row)")


def _cache_root(cache_dir: str | None) -> str:
    """Where compiled kernels are kept: the model's cache_dir (ModelConfig), else ~/.cache/switchyard."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    return cache_dir or default_cache_root()


def shard_cores(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores shard local_rank of local_world_size runs on: disjoint equal slices of
    cores (the remainder left to the OS); with more shards than cores, one core each,
    round-robin, so shards share cores but each still runs one thread."""
    if local_world_size > len(cores):
        return [cores[local_rank % len(cores)]]
    per_shard = len(cores) // local_world_size
    return cores[local_rank * per_shard:(local_rank + 1) * per_shard]


def _meminfo_available_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


# What holds torch's own kernels to a level too (ATen's vectorized loops, oneDNN's JIT), read by
# those libraries when they load: a forced level runs no instruction of the levels above it.
_TORCH_ISA = {"portable": ("default", "SSE41"), "avx2": ("avx2", "AVX2"), "avx512": ("avx512", "AVX512_CORE"),
              "avx512-vnni": ("avx512", "AVX512_CORE_BF16"), "amx": ("avx512", "AVX512_CORE_AMX")}


def torch_isa_environment(isa: str) -> dict[str, str]:
    aten, onednn = _TORCH_ISA[isa]
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


def preferred_dtype(flags: frozenset[str] | None = None) -> str:
    """bfloat16 where this CPU multiplies it natively (AVX512-BF16 or AMX, runtime.py) and
    torch's oneDNN can use it; float32 elsewhere (bf16 emulated is slower than float32)."""
    flags = cpu_flags() if flags is None else flags
    if prefers_bfloat16(flags) and torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16"
    return "float32"


class CpuBackend(ProcessGroupShards, Backend):
    name = "cpu"
    priority = 0
    dist_backend = "gloo"

    def __init__(self, pack_weights: bool = True, in_place_decode: bool = True, fused_decode: bool = True) -> None:
        self._plans = StepPlanCache()  # shared by every layer's kernel: one plan per step
        # Decode attention in place (C++, built at warm-up); in_place_decode=False forces the gather path.
        self._decode = PagedDecode(enabled=in_place_decode, max_decodes=IN_PLACE_MAX_DECODES)
        # Reorder float32/bf16 linear weights for oneDNN once, at load (see linear.py).
        self.pack_weights = pack_weights and packing_supported()
        self._local_shards = 1  # shards of one model on this machine share its memory
        self._shards = 1  # shards of the model in all (the whole model's size, for resolve_activations)
        self._activations = ""  # how block-format weights meet activations, once prepare_model has decided
        # Decode-only steps of Llama-layout models through the C++ layers (fused_decode.py) when
        # the engine asks for prepared decode steps (EngineConfig.compile_decode); False: compiled graphs.
        self.fused_decode = fused_decode
        self._isa = ""  # the level the kernels run at, once prepare_model has built them
        # what prepare_model learns of the engine's configuration, for kernels built later (lora_kernel)
        self._isa_setting, self._cache_dir = "auto", None
        self._lora: CpuLoraKernel | None = None

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "always available")

    def capabilities(self) -> Capabilities:
        # the kernel gathers whole blocks of any size; small ones serve tiny test models
        return Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=False,
                            static_shapes=False, attention_impl=self.attention_impl(),
                            quantizations=served_by(self.name),
                            preferred_dtype=preferred_dtype(), runtime=this_machine().describe(),
                            # a verify's tokens are decode rows (core/execution/runner.py decodes_by_row): the
                            # fused C++ layers run them; the compiled graphs leave them to eager steps
                            multi_token_decode=True,
                            # 2-core AMX Xeon, the default model: 8.5 ms a one-row step, +1.2 ms a row
                            decode_row_cost=0.15,
                            isa_levels=tuple((level, preferred_dtype(level_flags(level))) for level in isa_levels()),
                            # block formats: integer products against int8 activations (quant.py)
                            integer_quantizations=("gguf", "int4"),
                            # every path reads and writes them: the C++ decode kernel and layers, the gather path
                            kv_cache_dtypes=("int8", "fp8_e4m3fn", "fp8_e5m2"),
                            vision_encoders=True,  # the SigLIP tower in plain torch (core/multimodal)
                            # the gather path's masks and the C++ decode kernel (attention.py)
                            window_anchors=True,
                            # csrc/lora.cpp (lora.py), plain torch where it cannot be built
                            lora=True)

    def process_environment(self, config) -> dict[str, str]:
        """The tuned runtime of runtime.py (allocator, Intel OpenMP, threads, binding when the
        engine process is the model's only process), merged with the user's environment."""
        held = {} if config.isa == "auto" else torch_isa_environment(config.isa)
        if config.runtime == "plain":
            return {**os.environ, **held} if held else {}
        return {**this_machine(config.parallel.sharded).environment(os.environ), **held}

    def attention_impl(self, cache_dir: str | None = None) -> str:
        decodes = self._decode.describe(_cache_root(cache_dir))
        return (f"decodes: {decodes}; prompt chunks and gathered decodes: {GATHER_IMPL}; {describe_linears()}; "
                f"{describe_fused()}: {describe_compiled(_cache_root(cache_dir))}")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Sharded: as many torch threads as this shard's slice of the cores (shard_cores),
        then the gloo group. A worker process is pinned to its slice; rank 0 is not, since it
        shares the engine's process (and what it starts later, e.g. grammar workers, would
        inherit the pinning): it runs on the slice the workers leave free."""
        self._local_shards, self._shards = shard.local_world_size, shard.world_size
        if not shard.sharded:
            logger.info("cpu runtime: %d torch threads; loaded: %s", torch.get_num_threads(),
                        ", ".join(loaded_libraries()) or "no OpenMP or allocator library")
        if shard.sharded:
            cores = shard_cores(sorted(os.sched_getaffinity(0)), shard.local_rank, shard.local_world_size)
            if shard.rank != 0:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
            logger.info("shard %d on cores %s%s", shard.rank, cores, "" if shard.rank else " (unpinned)")
        super().init_device(shard)

    def available_memory_bytes(self) -> int:
        """This shard's share of the machine's available memory."""
        available = _meminfo_available_bytes()
        if available is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return available // self._local_shards

    def num_kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        """From what the configuration needs, not from the memory free now (core/kv/sizing.py):
        at most DEFAULT_KV_TOKENS tokens of it (or one whole-context request), or at most
        --kv-cache-memory bytes."""
        return blocks_from_configuration(bytes_per_block, cache)

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return CpuAttentionKernel(spec, self._plans, self._decode)

    def prepare_model(self, loaded, config) -> None:
        """Swaps quantized linears for their kernels (quant.py), packs the float linear weights
        for oneDNN (linear.py; bf16 ones with the bf16 row kernel for few-row steps, _rows_kernel), then tells the remaining linears how this CPU multiplies a
        single row (tuning.py). The plain runner runs the result."""
        self._say_isa(config.isa)
        self._isa_setting, self._cache_dir = config.isa, config.model.cache_dir
        if config.lora.enabled:
            logger.info("LoRA deltas: %s", self.lora_kernel().path)
        if any(isinstance(m, Linear) and m.quantized is not None for m in loaded.model.modules()):
            blocks = load_block_kernel(_cache_root(config.model.cache_dir), isa=config.isa)
            activations = resolve_activations(config.quantized_activations, linear_weights(loaded.model, self._shards))
            pack_quantized(loaded.model, blocks, QUANTIZED_BATCH_ROWS if self.pack_weights else None, activations)
            if any(isinstance(m, BlockLinear) for m in loaded.model.modules()):
                self._activations = activations
        if self.pack_weights:
            pack_linears(loaded.model, self._rows_kernel(loaded, _cache_root(config.model.cache_dir), config.isa))
        choose_single_row_products(loaded.model)

    def kernel_isa(self) -> str:
        return self._isa

    def quantized_activations(self) -> str:
        return self._activations

    def lora_kernel(self) -> CpuLoraKernel:
        """csrc/lora.cpp built (or reused) at the engine's instruction-set level (prepare_model
        learns it; "auto" before), once; the plain-torch reference, its reason logged once, where
        it cannot be built."""
        if self._lora is None or self._lora.isa != self._isa_setting:
            self._lora = CpuLoraKernel.load(_cache_root(self._cache_dir), self._isa_setting)
        return self._lora

    def _say_isa(self, isa: str) -> None:
        """Once per engine: the instruction-set level every kernel is built for (the start log, /info)."""
        level = resolve_isa(isa)
        self._isa = level if isa == "auto" else f"{level} (forced; this CPU runs up to {isa_levels()[-1]})"
        logger.info("CPU kernels: %s%s", self._isa, "" if level != "portable" or isa != "auto" else
                    ": this CPU has no AVX2, so plain C++ loops run (correct, slower than a vector build)")

    def _rows_kernel(self, loaded, cache_root: str, isa: str):
        """The bf16 row kernel's ops for this model's few-row steps (linear.py), or None. Where bf16
        packs as float32 its copy replaces the float32 one-row packing; beside a bf16 packing it is
        a second copy of the weights, made only while that stays under an eighth of the memory
        available."""
        if rows_kernel_rows(loaded.dtype) == 0:
            return None
        if loaded.dtype in packable_dtypes():
            copy = sum(m.weight.numel() * m.weight.element_size() for m in loaded.model.modules()
                       if isinstance(m, Linear) and m.weight.dtype == loaded.dtype)
            if copy > self.available_memory_bytes() // 8:
                logger.info("CPU bf16 row kernel off: its copy of the weights (%.1f GiB) would take more than "
                            "an eighth of the memory available", copy / 2**30)
                return None
        return load_rows_kernel(cache_root, isa).ops

    def make_runner(self, loaded, kv_caches: list[torch.Tensor], config):
        """Once the in-place decode kernel is built or reused (extension.py; the gather path, with
        its reason logged, if it cannot be): the eager runner (runner.py), or with `config.compile_decode`
        the runner whose decode-only steps run every layer in C++ (fused_decode.py; LoRA adapters'
        deltas too, once the loader sets its `lora`) when the model declares the Llama decoder
        layout, else the runner of decode graphs compiled here, at warm-up (compiled.py)."""
        cache_root = _cache_root(config.model.cache_dir)
        self._decode.load(cache_root, isa=config.isa)
        if not config.compile_decode:
            return CpuModelRunner(loaded.model, self, kv_caches, config.cache.block_size)
        layout = loaded.model.decoder_layout()
        fused = self._fused_program(layout, loaded.dtype, config, cache_root)
        if not isinstance(fused, str):
            logger.info("CPU decode steps: every layer in C++ (fused decode layers)")
            return FusedDecodeRunner(loaded.model, self, kv_caches, config.cache.block_size, layout, fused)
        if config.lora.enabled:  # graphs compiled now would hold the layers without their adapters
            logger.info("LoRA adapters: steps run the model's layers (no fused decode layers: %s)", fused)
            return CpuModelRunner(loaded.model, self, kv_caches, config.cache.block_size)
        logger.info("CPU fused decode layers off (%s): decode steps compiled instead", fused)
        runner = CompiledDecodeRunner(
            loaded.model, self, kv_caches, config.cache.block_size,
            sizes=compile_sizes(config.scheduler.max_num_seqs, config.graph_batch_sizes),
            max_model_len=loaded.max_model_len, options=CompileOptions(cache_root),
            disabled_reason=self._cannot_compile(config))
        runner.compile()
        return runner

    def _fused_program(self, layout, dtype: torch.dtype, config, cache_root: str):
        """The fused decode program (fused_decode.py) of a model's declared layout, or why it has none."""
        if not self.fused_decode:
            return "switched off"
        if self._decode.op is None:
            return "the in-place decode kernel is not loaded"
        if config.parallel.sharded:
            return "tensor-parallel shards"
        return fused_program(layout, load_decode_layers(cache_root, config.isa), dtype)

    def _cannot_compile(self, config) -> str | None:
        """Why decode steps cannot be compiled here, or None."""
        if self._decode.op_name is None:  # graphs attend through the in-place kernel alone
            build = self._decode.build
            return "the in-place decode kernel is " + ("switched off" if build is None else
                                                        f"unavailable ({build.reason})")
        if config.parallel.sharded:
            return "tensor-parallel shards run eager"
        return None

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        """Zeroed caches in anonymous mappings, whose pages the OS hands out on first touch, a
        4 KiB page at a time (no huge pages), so a large cache costs only what its used blocks
        hold; refused (KVCacheTooLarge, one line) when the whole of it would not fit in the
        memory available now, since used it will be. Zeros matter: the kernel reads whole
        blocks, and masked slots must hold finite values. (numpy's zeros, used before, advise
        buffers over 4 MiB into 2 MiB huge pages: the warm-up's one request made ~60 MB of the
        default model's cache resident, 2 MiB per layer.)"""
        shape, nbytes = spec.cache_shape(num_blocks), num_blocks * spec.cache_block_bytes
        check_fits(KVCacheSize(num_blocks, spec.block_size, nbytes * num_layers), self.available_memory_bytes())
        return [torch.frombuffer(small_pages(nbytes), dtype=torch.uint8).view(spec.cache_dtype).view(shape)
                for _ in range(num_layers)]
