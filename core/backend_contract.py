"""The backend contract: the types a hardware plugin and the engine core share, and
`BackendInterface`, what the code that builds and runs models (loader, runner, shards)
asks of a backend.

Nothing here imports core's implementations or vendor code, so every module of core may
import it. The class a backend subclasses is `Backend` (core/backend.py): this interface
plus the hooks over a loaded model and the engine's default implementations of the hooks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import torch

from .config import CacheConfig, EngineConfig

# Share of available_memory_bytes() the KV cache takes when CacheConfig.memory_fraction is None.
DEFAULT_MEMORY_FRACTION = 0.3

# The storage of each quantized --kv-cache-dtype (config.KV_CACHE_DTYPES other than "auto"). A
# quantized cache holds, for every token and KV head, a row of head_dim one-byte codes followed by
# the KV_SCALE_BYTES bytes of a float32 scale: value = code * scale, the code read as this dtype. The
# cache tensor has the code's dtype (so its dtype names its format) and a last dimension of
# head_dim + KV_SCALE_BYTES. core/kv/quantized.py computes codes and scales (absmax per row).
KV_CACHE_FORMATS: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3fn": torch.float8_e4m3fn,
                                            "fp8_e5m2": torch.float8_e5m2}
KV_SCALE_BYTES = 4


@dataclass(frozen=True)
class ProbeResult:
    usable: bool
    reason: str


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve. The engine refuses a dtype or block size outside these
    lists and turns off prefix caching / mixed steps a backend cannot do (capabilities.py)."""

    dtypes: tuple[str, ...]
    block_sizes: tuple[int, ...]
    mixed_prefill_decode: bool = True
    prefix_caching: bool = True
    # It may copy a cached block's first KV slots into another block before a step (a prefix hit
    # matched to the token, core/kv KVCopy, ModelRunner.copy_kv); False (static-shape graphs, where
    # each copy's indices would compile a graph): prefix hits stop at the last full block.
    partial_prefix_hits: bool = True
    graph_mode: bool = False
    static_shapes: bool = False
    attention_impl: str = ""  # which kernel and why, printed by `switchyard backends`
    # What `--dtype auto` (the CLI's default) becomes on this backend; must be one of dtypes.
    preferred_dtype: str = "float32"
    # `--quantize` values this backend runs (e.g. "int8", "int4", "gguf"); others are refused.
    quantizations: tuple[str, ...] = ()
    # The process runtime its engine process asks for (Backend.process_environment): allocator,
    # OpenMP runtime, threads; printed by `switchyard backends`. "" = nothing asked.
    runtime: str = ""
    # Why this backend cannot run a model in shards here (--num-shard > 1 is refused with it,
    # in one line); "" = it can, given a dist_backend.
    unshardable_reason: str = ""
    # Whether a decoding request may carry several query tokens in one step (its last token and
    # speculative proposals, core/spec), with logits at each: attention over the existing KV
    # context as for a prompt chunk. Speculative decoding is turned off (one logged line) where not.
    multi_token_decode: bool = False
    # About what one more query row costs a decode step, relative to the step's fixed time: the
    # speculator's starting point before it has measured this machine (core/spec/cost.py). Small
    # on accelerators at small batches; a CPU's rows are dear (its arithmetic is the bottleneck).
    decode_row_cost: float = 0.02
    # The instruction-set levels the backend can hold its kernels to (EngineConfig.isa), lowest
    # first, the last being what "auto" runs, each with what `--dtype auto` becomes there (the
    # level's preferred_dtype); () = the backend has no such choice.
    isa_levels: tuple[tuple[str, str], ...] = ()
    # Quantization methods whose weights the backend multiplies in integers against activations
    # it rounds per block itself: `--dtype auto` serves them in float32, since wider activations
    # around the integer products cost no speed there and every machine then computes alike.
    integer_quantizations: tuple[str, ...] = ()
    # The quantized KV caches (--kv-cache-dtype, KV_CACHE_FORMATS names) its attention kernels write
    # and read; "auto" (the model's dtype) is always served, any other value is refused at start.
    kv_cache_dtypes: tuple[str, ...] = ()
    # Whether its runner hands back the final hidden states of pooling requests' tokens
    # (ModelRunner.last_pooling_hidden, core/pooling): an embedding model is refused at start where not.
    pooling: bool = True
    # Whether it serves LoRA adapters (core/lora): then Backend.lora_kernel returns its batched
    # low-rank kernel. --lora-adapters / --enable-lora are refused at start, in one line, where not.
    lora: bool = False
    # Whether it runs a vision-language model's vision tower (core/models/siglip.py: plain torch
    # modules on its device, core/multimodal). Where not, such a model serves text only: its start
    # logs one line saying so and a request with images is refused (400).
    vision_encoders: bool = False
    # Whether its attention honours AttentionMetadata.window_anchors in sliding-window layers (a
    # decode row's window counted back from its own position, not from seq_len - 1). The runner
    # passes anchors only where this is declared; elsewhere a model whose image tokens attend both
    # ways (CausalLM.bidirectional_images) with sliding-window layers keeps the seq_len - 1 window,
    # approximate for image tokens past the window (one logged line, core/multimodal/image_rows.py).
    window_anchors: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None  # attend to at most this many most recent keys
    soft_cap: float | None = None  # logits -> soft_cap * tanh(logits / soft_cap)
    # What the KV cache stores: "auto" (dtype) or a KV_CACHE_FORMATS name (--kv-cache-dtype, set by
    # the loader on every layer's spec).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto":
            if self.kv_cache_dtype not in KV_CACHE_FORMATS:
                raise ValueError(f"KV cache dtype {self.kv_cache_dtype!r} is not one of "
                                 f"auto, {', '.join(KV_CACHE_FORMATS)}")
            if self.head_dim % KV_SCALE_BYTES:
                raise ValueError(f"a quantized KV cache needs a head_dim that is a multiple of {KV_SCALE_BYTES} "
                                 f"(its float32 scales stay aligned), got {self.head_dim}")

    @property
    def quantized_cache(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache tensor's dtype: the model's, or a quantized format's code."""
        return KV_CACHE_FORMATS[self.kv_cache_dtype] if self.quantized_cache else self.dtype

    @property
    def cache_row(self) -> int:
        """The cache's last dimension: head_dim, and a quantized cache's scale bytes after it."""
        return self.head_dim + (KV_SCALE_BYTES if self.quantized_cache else 0)

    @property
    def cache_block_bytes(self) -> int:
        """Bytes of one block of one layer's cache, keys and values."""
        element = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.cache_row * element

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache: [2, num_blocks, block_size, num_kv_heads, cache_row]."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.cache_row)


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of the flat token batch (no padding between requests).

    Requests are ordered decodes first (query length 1), then prompt chunks.

    A decode row attends to keys [0, seq_len); in a sliding-window layer (AttentionSpec.sliding_window
    W) only to those > anchor - W, where its anchor is seq_len - 1 unless `window_anchors` says
    otherwise. The runner sets window_anchors only for a step that holds image rows of a model whose
    image tokens attend both ways (core/multimodal/image_rows.py: an image token's row has seq_len =
    its image's last position + 1, and its anchor is its own position), and only for a backend that
    declares Capabilities.window_anchors; its entries are key positions (never the RoPE positions),
    seq_len - 1 for every row without an anchor of its own and for every prompt chunk (whose tokens
    each keep their own position as anchor). Layers without a window ignore it. Decode-only steps
    of graphs and fused decode paths never carry it (their image steps are not decode-only).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32: where each request's tokens start
    seq_lens: torch.Tensor  # [B] int32: context length after this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with 0 (reserved block)
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # [B] int32 on the step's device, and its host twin: the position each request's window counts
    # back from (see above); None: seq_len - 1 for every request (every step but image rows').
    window_anchors: torch.Tensor | None = None
    window_anchors_cpu: tuple[int, ...] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class LoraBatch:
    """Which adapter each token of a step uses (core/lora), in two views of one fact.
    token_slots [T] int32: the resident slot of each token's adapter, -1 for the base model (BGMV's
    view); segments: host-side (start, stop, slot) runs of tokens with one slot >= 0, in token order
    (SGMV's view: a request's tokens are contiguous, so a step has few runs)."""

    token_slots: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]


class LoraKernel(ABC):
    """Batched low-rank deltas of many adapters in one step (punica's SGMV/BGMV): for each token t
    with slot s = batch.token_slots[t] >= 0, y[t] += scales[s] * B[s] @ (A[s] @ x[t]). The stacks
    hold every resident adapter of a layer, their ranks padded with zeros to the stack's R; rows of
    tokens without an adapter are left as they are. Computed in the dtype of x (float32
    accumulation), and a token's delta never depends on the other tokens of the step."""

    @abstractmethod
    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """x [T, in], a [S, R, in] -> h [T, R] (h[t] = A[s] @ x[t]; rows of slot -1 unspecified)."""

    @abstractmethod
    def expand(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               batch: LoraBatch) -> None:
        """y [T, out] += scales[s] * h[t] @ B[s].T in place, with b [S, out, R] and scales [S]
        float32. y may be a column slice of a wider output (a fused projection's part): its rows
        are strided."""


class AttentionKernel(ABC):
    """Paged attention for one layer shape. KV cache, per layer, indexed as
    [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values), of spec.cache_dtype,
    with the scale's bytes after each row's codes in a quantized cache (spec.cache_row,
    KV_CACHE_FORMATS); its memory layout (strides) is the backend's, from Backend.allocate_kv_cache."""

    # True when forward() on a decode-only batch reads only the metadata's device tensors and
    # shapes (never its host tuples), so a graph-mode runner may capture and replay its launches.
    graph_safe: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Scatter new keys/values [T, num_kv_heads, head_dim] into their slots."""

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of query [T, num_heads, head_dim] over each request's
        cached prefix plus its new tokens; returns [T, num_heads, head_dim]."""


@dataclass(frozen=True)
class ShardInfo:
    """Where one shard runs: its global rank of world_size, its index among this machine's
    shards (the device it drives, LOCAL_RANK), and the torch.distributed rendezvous."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_world_size: int = 1  # shards on this machine (e.g. how many share its CPU cores)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


SINGLE_SHARD = ShardInfo()


class Communicator(Protocol):
    """Collectives among the shards of one model (in place where the name says so)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...


class ShardGroup(Protocol):
    """Processes started by a ShardLauncher."""

    def failure(self) -> str | None:
        """None while every shard runs; else which shard ended and how (its last error)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate every shard (SIGTERM, then SIGKILL after timeout) and reap it."""

    def wait(self, timeout: float | None = None) -> bool:
        """Waits up to timeout (None: forever) for every shard to end; True when all have."""


class ShardLauncher(Protocol):
    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ShardGroup:
        """Start one process per ShardInfo running target(shard, *args); returns at once."""


class BackendInterface(ABC):
    """One hardware family, as the model-building code sees it. Subclass `Backend`
    (core/backend.py), which implements the hooks marked abstract here that have defaults.
    Subclasses set `name` and `priority` (higher wins when several are usable and none was
    asked for)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    # torch.distributed backend its shards talk over ("gloo", "nccl", "xccl"); None = one shard only
    dist_backend: ClassVar[str | None] = None
    # The attention kernel `switchyard backends` names when the backend is not usable here
    # (capabilities() is only asked of usable ones, whose attention_impl it then prints).
    planned_attention_impl: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Cheap, no device context, never raises."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def process_environment(self, config: EngineConfig) -> dict[str, str]:
        """Environment variables the engine process must start with to run this backend well
        (preloaded libraries, OpenMP settings, a setting a library reads only from its
        environment), already merged with the present os.environ so that a user's own values
        stay. Asked by the engine process (core/engine/process.py) right after it selects the
        backend, before anything is loaded: when they are not in effect it re-executes itself
        once with them, and the shard processes it starts inherit them.
        `config.runtime == "plain"` asks for no tuning. Cheap, no device context. The default
        asks for nothing."""
        return {}

    def kernel_isa(self) -> str:
        """The instruction-set level its kernels run at (EngineConfig.isa resolved, e.g. "avx2
        (forced)"), once prepare_model has run; reported in /info. "" where it has no such choice."""
        return ""

    def quantized_activations(self) -> str:
        """How its integer kernels round the activations for the loaded model's quantized weights
        (EngineConfig.quantized_activations, "auto" decided: "int8x2" or "int8"), once
        prepare_model has run; reported in /info. "" where no such kernel multiplies the model."""
        return ""

    @abstractmethod
    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Create the device context for shard.local_rank, and join the shard group
        (core/shards/distributed.py init_process_group, which also makes the control group) when
        shard.sharded. Called once per process, before loading."""

    @abstractmethod
    def available_memory_bytes(self) -> int:
        """Memory the KV cache may be sized from, measured after weights are loaded."""

    @abstractmethod
    def attention(self, spec: AttentionSpec) -> AttentionKernel: ...

    def num_kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        """KV capacity in blocks when the configuration names none. Default: memory_fraction
        (DEFAULT_MEMORY_FRACTION when None) of available_memory_bytes(), at most max_auto_blocks."""
        fraction = DEFAULT_MEMORY_FRACTION if cache.memory_fraction is None else cache.memory_fraction
        budget = int(self.available_memory_bytes() * fraction)
        return max(2, min(cache.max_auto_blocks, budget // bytes_per_block))

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        return [torch.zeros(spec.cache_shape(num_blocks), dtype=spec.cache_dtype, device=self.device)
                for _ in range(num_layers)]

    @abstractmethod
    def lora_kernel(self) -> LoraKernel | None:
        """Its batched low-rank kernel of LoRA adapters when Capabilities.lora; None when not."""

    @abstractmethod
    def communicator(self) -> Communicator | None:
        """Collectives of this process's shard group; None when not sharded."""

    @abstractmethod
    def shard_launcher(self) -> ShardLauncher | None:
        """Starts this backend's shard processes; None when it cannot shard (dist_backend None)."""
