"""Frozen configuration passed from the CLI (or the offline API) into the engine."""
from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import ClassVar


def default_cache_root() -> str:
    """Where Switchyard keeps what it builds once (converted GGUF directories, compiled kernels,
    engine environments) when ModelConfig.cache_dir is None: $XDG_CACHE_HOME/switchyard."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "switchyard")


@dataclass(frozen=True)
class ModelConfig:
    """What to load. `model` is None for the default model, a local HF directory,
    a .gguf file, or a name in the local Hugging Face cache."""

    model: str | None = None
    # "float32" | "bfloat16" | "float16" | "auto" (the backend's preferred dtype, capabilities.py)
    dtype: str = "float32"
    # Weight quantization (TGI's --quantize): None = the checkpoint's weights in `dtype`; else a
    # name the backend declares in Capabilities.quantizations ("int8", "int4", "gguf", ...).
    quantize: str | None = None
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    revision: str | None = None
    seed: int = 0  # seed of dummy weights
    max_model_len: int | None = None  # None = the model's own context length
    # GGUF files are converted once into a Hugging Face directory kept here;
    # None = $XDG_CACHE_HOME/switchyard (~/.cache/switchyard); "" = convert in memory at every load.
    cache_dir: str | None = None
    # A chat template (a Jinja file's path, or the template text) that replaces the
    # tokenizer's own; None = the tokenizer's (a base model may have none).
    chat_template: str | None = None
    # Which model code runs it: "auto" (native when there is native code for the model_type,
    # else the transformers fallback) | "native" | "transformers" (--model-impl).
    model_impl: str = "auto"
    # Run a checkpoint's own modeling code (config.auto_map) from its local directory.
    trust_remote_code: bool = False
    # How the model is served (--task, vLLM's): "generate", "embed" (a pooling model: one vector
    # per prompt, core/pooling) or "auto" (the model's files decide: core/pooling/decide.py).
    task: str = "auto"
    # Under "embed": how the prompt's hidden states are pooled, "last" | "mean" | "cls", over what
    # the model's files say (--pooling); None = theirs.
    pooling: str | None = None
    # llama.cpp's mmproj GGUF (--mmproj): the vision tower and connector served with the language
    # model's GGUF in `model` (core/loader/mmproj.py); None: the model as it is.
    mmproj: str | None = None
    # A vision-language model's vision tower and connector: "auto" runs them in `dtype`; where
    # `dtype` "auto" became float32 only because the language model's weights are multiplied in
    # integers, core/capabilities.py sets the float dtype the backend prefers (on a CPU with
    # bfloat16 products, bfloat16). An explicit --dtype is the tower's too.
    vision_dtype: str = "auto"


# --kv-cache-dtype values (TGI's names for float8, llama.cpp's q8_0 in spirit for int8): "auto" stores
# the KV cache in the model's dtype; the others store one-byte codes with a float32 scale per token
# and KV head (core/backend_contract.py KV_CACHE_FORMATS: the layout; core/kv/quantized.py: the
# arithmetic). A backend declares those it reads (Capabilities.kv_cache_dtypes).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3fn", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # What the KV cache stores (--kv-cache-dtype, one of KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"
    # KV capacity in blocks (--num-kv-blocks, --max-batch-total-tokens); None = sized at warm-up by
    # the backend: the CPU from what the configuration needs (core/kv/sizing.py), device backends
    # from a fraction of their memory.
    num_blocks: int | None = None
    # Share of memory the KV cache is sized from, on backends that size it so; None = the backend's
    # default. CUDA/ROCm: TGI's --cuda-memory-fraction, the fraction of total device memory the
    # process may use (default 1.0); others: of the memory left after loading (default 0.3).
    memory_fraction: float | None = None
    # Bytes the KV cache takes when sized from the configuration (CPU): like vLLM-CPU's KV cache
    # space, what the configuration can hold (usable_tokens) up to this many bytes; None = up to
    # sizing.DEFAULT_KV_TOKENS tokens (--kv-cache-memory). A given num_blocks is taken as it is.
    kv_cache_memory: int | None = None
    # Tokens the configuration can hold at once (max_num_seqs x max_model_len) and of one request
    # (max_model_len): set by the engine once the model's context is known (sizing.with_usable_tokens);
    # None = not known yet.
    usable_tokens: int | None = None
    context_tokens: int | None = None
    # Bytes of one KV block (every layer) in the model's dtype, set with usable_tokens: the automatic
    # budget is that many tokens' bytes at this size, so a quantized cache holds more tokens in it;
    # None = the cache's own bytes per block.
    model_dtype_block_bytes: int | None = None
    # Upper bound of blocks when sizing automatically (keeps a CPU process polite; CUDA ignores it).
    max_auto_blocks: int = 16384
    # Hash full prompt blocks and reuse them across requests (--disable-prefix-caching turns it off).
    enable_prefix_caching: bool = True
    # ... and, after them, the first slots of a cached block that begin like the request's next
    # tokens, copied (core/kv KVCopy); off where the backend cannot (Capabilities.partial_prefix_hits).
    partial_prefix_hits: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    # Token budget of one step (prompt chunks + decodes): TGI --max-batch-prefill-tokens.
    max_num_batched_tokens: int = 2048
    # Most requests running at once: TGI --max-batch-size.
    max_num_seqs: int = 256
    # Backends that cannot mix prefill and decode in one step set this False; their steps
    # are prefill-only or decode-only, chosen by TGI's router policy (core/scheduling/prefill_policy.py):
    # a prefill step once waiting >= floor(decoding * waiting_served_ratio) (TGI
    # --waiting-served-ratio), or after max_waiting_tokens - 1 decode steps in a row (TGI
    # --max-waiting-tokens), or when nothing can decode.
    mixed_prefill_decode: bool = True
    # False: a prompt is computed whole in one step, never in chunks (an encoder's tokens attend
    # to the whole prompt; set by the engine for such models, core/pooling/serving.py).
    chunk_prompts: bool = True
    # True: a prompt chunk never ends inside an image's image tokens (a model whose image tokens
    # attend to each other both ways, CausalLM.bidirectional_images; set by the engine,
    # core/engine/shard_worker.py; core/scheduling/encoder_budget.py decides where chunks stop).
    whole_images: bool = False
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


@dataclass(frozen=True)
class GrammarConfig:
    """Grammar-constrained decoding (core/grammar): which compiler, and its limits.

    Compiles run in `compile_workers` worker processes at low priority (`worker_nice`), plus a
    warm spare for small and medium specs, so a heavy grammar never takes CPU from the engine's
    step loop nor holds up a lighter one, and one that runs past `compile_timeout_s` is killed
    with its process (never cached)."""

    backend: str = "xgrammar"  # "xgrammar" | "outlines" (--grammar-backend)
    cache_size: int = 128  # compiled grammars kept per tokenizer (LRU), at most ...
    cache_bytes: int = 256 << 20  # ... and at most this many bytes of them (--grammar-cache-bytes)
    # largest compiled grammar (xgrammar: its memory; outlines: its index serialized). Size grows
    # steeply with enums: 5,000 values 0.7 MB, 10,000 values 43 MB and 3.5 s (--grammar-max-compiled-bytes)
    max_grammar_bytes: int = 64 << 20  # an outlines index of a test schema pickles to 25 MiB
    compile_timeout_s: float = 30.0  # a slower compile is killed and fails its request alone
    max_spec_bytes: int = 256 << 10  # largest schema / regex text (--grammar-max-spec-bytes)
    # Compile slots for grammars of any size: worker processes (threads for a compiler that cannot
    # cross a process); None = default_compile_workers() (--grammar-workers).
    num_compile_workers: int | None = None
    # One more slot, its worker started ahead (warm), that takes only specs of at most this many
    # bytes: a small or medium grammar never waits behind heavy ones busy on every other slot.
    # Medium: on the default model's vocabulary a 64 KiB schema (an enum of ~3,000 values, an
    # object of ~450 properties) compiles in 0.1-0.3 s, the heavy ones that hold the other slots
    # (~220 KB enums) in seconds. 0 = no spare.
    spare_max_spec_bytes: int = 64 << 10
    worker_nice: int = 10  # added niceness of the worker processes
    use_processes: bool = True  # False: compile in threads of this process (no isolation)
    worker_start_timeout_s: float = 120.0  # a worker importing the compiler and reading its tables

    @property
    def largest_grammar_bytes(self) -> int:
        """A compiled grammar past this is refused: it could never stay in the cache."""
        return min(self.max_grammar_bytes, self.cache_bytes)

    @property
    def compile_workers(self) -> int:
        """The compile slots for grammars of any size (the spare comes on top)."""
        return self.compile_workers_on(None)

    def compile_workers_on(self, cpus: Collection[int] | None) -> int:
        """The compile slots of an engine given `cpus` (ParallelConfig.cpus; None: what the
        machine offers)."""
        return max(1, self.num_compile_workers if self.num_compile_workers is not None
                   else default_compile_workers(cpus))


def default_compile_workers(cpus: Collection[int] | None = None) -> int:
    """min(2, the CPUs the workers may run on): a compile is one niced thread, so it only takes
    CPU the engine leaves idle; two let a second heavy compile run beside the first, while more
    on a small machine would only divide the same idle CPU, each worker holding ~0.3 GB (xgrammar
    imports torch). The CPUs are `cpus`, else the machine's and cgroup's
    (core/grammar/placement.py), never the calling thread's mask: a CPU engine binds its main
    thread to one core."""
    from .grammar.placement import worker_cpus

    return max(1, min(2, len(worker_cpus(cpus))))


# ParallelConfig.executor_backend's values, and Ray's placement strategies (ray_placement_strategy).
EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (--num-shard): world = tensor_parallel_size shards, split evenly
    over nnodes machines. Node 0 runs the engine (rank 0) and its local shards; a node
    k > 0 runs only its local shards. The rendezvous is rank 0's store at master_addr:
    master_port (torch.distributed's tcp://); master_port None = a free port on this
    machine, which only a single node may use."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # The logical CPUs this engine's process (and so its shards and grammar workers) may run on;
    # None = what the server may. Set per data-parallel replica (gateway/replicas.py) so replicas
    # never share cores; applied once, first thing in the engine process (core/engine/process.py),
    # before the backend plans its threads from the process's affinity.
    cpus: tuple[int, ...] | None = None
    # Who starts shards 1..N-1 (vLLM's --distributed-executor-backend): "mp" = the backend's
    # launcher (local processes, one `serve` per node); "ray" = Ray actors in a placement group
    # on the cluster at ray_address (core/shards/ray_launcher.py), one bundle per shard placed with
    # ray_placement_strategy (PACK | SPREAD | STRICT_PACK | STRICT_SPREAD).
    executor_backend: str = "mp"
    ray_address: str = "auto"
    ray_placement_strategy: str = "PACK"

    @property
    def sharded(self) -> bool:
        return self.tensor_parallel_size > 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (core/spec/, TGI's --speculate): each decoding request may verify up to
    `num_speculative_tokens` proposed tokens per step; 0 = off. Proposals come from:

    - method "ngram": n-gram lookup in the request's own tokens (prompt and output): the longest
      suffix of `ngram_max` down to `ngram_min` tokens that occurred before, within the last
      `ngram_window` tokens (0 = all);
    - method "draft": a draft model (`draft_model`: a path or name as ModelConfig.model takes it,
      --speculative-model) sharing the target's tokenizer, loaded like the target (its dtype,
      cache directory and model code choice) and run greedily beside it with its own paged KV
      cache of `draft_num_blocks` blocks (None: as many as the target's, the same tokens).

    With `adaptive` (the default), each request proposes up to k tokens, as many as pay for the
    rows they add at the step's batch size, from its measured acceptance and the row cost the
    engine's steps measure (core/spec/adaptive.py), so traffic the proposals miss, and batches
    where rows are dear, run as without speculation; a request whose per-token acceptance is
    below `min_acceptance` never proposes. Without `adaptive`, every decode proposes k."""

    # --speculate N alone is n-gram lookup; --speculative-model without --speculate verifies this many
    DEFAULT_DRAFT_TOKENS: ClassVar[int] = 4
    METHODS: ClassVar[tuple[str, ...]] = ("ngram", "draft")

    num_speculative_tokens: int = 0  # --speculate N
    method: str = "ngram"  # the proposer (core/spec/proposer.py): "ngram" | "draft"
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_window: int = 0
    min_acceptance: float = 0.0
    adaptive: bool = True
    draft_model: str | None = None  # method "draft": --speculative-model
    draft_num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(self.METHODS)}, got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with method 'draft', and method 'draft' needs a draft_model")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def draft_model_config(self, target: ModelConfig) -> ModelConfig:
        """What to load as the draft: `draft_model` with the target's dtype, cache directory,
        seed and model code choice; its own weights' format and context length, unquantized
        unless its checkpoint is."""
        if self.draft_model is None:
            raise ValueError("no draft model is configured")
        return replace(target, model=self.draft_model, quantize=None, load_format="auto", revision=None,
                       max_model_len=None, chat_template=None)


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry tracing (core/tracing.py, gateway/tracing.py), TGI's --otlp-endpoint and
    --otlp-service-name; off while `otlp_endpoint` is None. Both processes export their own spans
    to the same collector; the exporters read the rest of OTEL_EXPORTER_OTLP_* themselves."""

    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4317 (gRPC) or :4318 (HTTP)
    service_name: str = "switchyard"
    protocol: str = "grpc"  # "grpc" | "http/protobuf" (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL)

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served over the base model (core/lora): TGI's --lora-adapters, vLLM's
    --enable-lora / --max-loras / --max-lora-rank."""

    # (name, path) of the PEFT adapters served from the start (--lora-adapters name=path,...)
    adapters: tuple[tuple[str, str], ...] = ()
    # --enable-lora: adapters may be loaded at run time even when none is named at start
    enable: bool = False
    # adapters resident at once, the stacks' slots (one step uses at most this many)
    max_loras: int = 8
    # the largest rank an adapter may have (the stacks' R)
    max_lora_rank: int = 16

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.adapters)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    backend: str | None = None  # None = the best usable backend
    # Batch sizes whose decode steps backends with graph mode capture (TGI --cuda-graphs);
    # None = the backend's own buckets, () = no graphs.
    graph_batch_sizes: tuple[int, ...] | None = None
    # Run decode-only steps the way the backend prepares them at warm-up (CPU: every layer in C++
    # for models that declare the Llama layout, else torch.compile graphs, one per bucket of
    # graph_batch_sizes). Off by default so the eager path stays the reference; `switchyard
    # serve` turns it on unless --enforce-eager.
    compile_decode: bool = False
    # The instruction-set level the backend's kernels are built for and run at, one of its
    # Capabilities.isa_levels (CPU: portable, avx2, avx512, avx512-vnni, amx); "auto" = the best
    # this machine runs. Forcing a lower one serves through the path a lesser CPU takes
    # (`--cpu-isa`, reported in /info and the start log).
    isa: str = "auto"
    # How a backend that multiplies block-quantized weights in integers rounds the activations:
    # "int8x2" (int8 per 32 values, then what that lost the same way: two integer products,
    # about 15 bits), "int8" (llama.cpp's one pass: half the integer work, a larger distance
    # from the float reference) or "auto" (the backend decides per model: on the CPU two passes
    # for small models, one for large, backends/cpu/quant.py resolve_activations;
    # `--quantized-activations`, reported in /info).
    quantized_activations: str = "auto"
    # Seeds the generator that unseeded random requests share (vLLM's --seed): an engine started
    # with it draws their noise in the same order every start, so the same requests in the same
    # batches get the same tokens. None = a fresh random seed at each start. A request's own
    # `seed` still gives it a generator of its own, independent of its neighbours.
    sampling_seed: int | None = None
    # How `switchyard serve` starts its engine process: "tuned" with the environment its backend
    # asks for (Backend.process_environment; CPU: tcmalloc/jemalloc and Intel OpenMP preloaded,
    # threads bound to cores), "plain" as it was launched (--runtime).
    runtime: str = "tuned"
    # The engine process loads and warms up at the lowest CPU priority (SCHED_IDLE), then serves at
    # the normal one: a model loaded on demand (gateway/models_registry.py) does not take the cores
    # of a model that is streaming beside it (core/engine/priority.py).
    start_in_background: bool = False
    # ... and stays there once ready (a models file's `priority: background`): it computes only
    # when the cores are otherwise free, so a model streaming beside it keeps its pace while it
    # answers (and it answers slower while the other streams).
    serve_in_background: bool = False
