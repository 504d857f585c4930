"""Decode-only steps of the CPU backend as compiled graphs (torch.compile, inductor).

Eager, a decode step of the default model runs ~60 small torch ops per layer, each
paying Python and dispatch overhead that at batch 1 costs more than its arithmetic.
At warm-up (`CompiledDecodeRunner.compile`) the whole step, model and LM head, is
compiled by inductor once per batch-size bucket (compile_sizes: few, since each
costs compile time at first start), with every layer's attention call an opaque
custom op (compiled_attention.py) so each bucket is one graph without breaks. A
decode-only step of B requests is staged into static buffers (core/execution/decode_batch.py),
padded to the smallest bucket >= B and run through that bucket's graph; padding rows
write no KV. Prompt chunks, mixed steps, prompt logprobs and batches above the
largest bucket run the eager path (ModelRunner.execute).

Compiled artifacts live under `<cache root>/inductor` (inductor's FX-graph cache), so
a second start of the same model and settings loads them instead of compiling.
When a bucket fails to compile, the runner logs why once and every step runs eager.

Measured 2026-12-01 on an idle 2-core AVX-512 Xeon (DEFAULT_SIZES): compiled / eager 0.83.
Freezing is required,
not a choice: inductor's oneDNN linear lowering takes packed weights only as constants.
cpp_wrapper is off: not yet measured. Known limit: inductor's FX-graph cache refuses
graphs whose constants are oneDNN (mkldnn) tensors, which the packed weights are, so a
second start reuses the compiled C++ kernels under the cache directory but traces and
lowers again (default model, two buckets: 353 s then 312 s on the loaded machine).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from dataclasses import dataclass

import torch

from switchyard.core.backend import Backend
from switchyard.core.execution.decode_batch import BucketedDecodeRunner, DecodeBuffers

logger = logging.getLogger(__name__)

# Buckets when the configuration names none (EngineConfig.graph_batch_sizes): batch 1 only.
# Measured on an idle 2-core AVX-512 Xeon (default model, bf16, interleaved, best of 2 rounds):
# compiled / eager step time 0.83 at c=1 and 0.83 at c=32, at ~30 s of compiling per bucket at
# every start (the FX-graph cache cannot keep these graphs, see above). A padded bucket runs
# the bucket's whole batch (c=17 in bucket 32 costs nearly a c=32 step), which loses to eager
# between buckets, so only batch 1, where the step is pure overhead, compiles by default;
# `--cuda-graphs 1,8,32` names more.
DEFAULT_SIZES = (1,)


@dataclass(frozen=True)
class CompileOptions:
    """How the decode graphs are built. `freezing`: inductor folds the weights into the graph
    as constants; `cpp_wrapper`: the graph's host code is C++ instead of Python."""

    cache_root: str
    freezing: bool = True
    cpp_wrapper: bool = False

    @property
    def cache_dir(self) -> str:
        return os.path.join(self.cache_root, "inductor")


def describe(cache_root: str) -> str:
    """For `switchyard backends`: what a server start does with decode steps."""
    return (f"decode-only steps compiled at warm-up, one graph per batch bucket (torch.compile, inductor; "
            f"default buckets {', '.join(map(str, DEFAULT_SIZES))}; cache {os.path.join(cache_root, 'inductor')}; "
            "--enforce-eager runs them eagerly)")


def compile_sizes(max_num_seqs: int, configured: tuple[int, ...] | None) -> tuple[int, ...]:
    """The buckets: the configured sizes (TGI's --cuda-graphs), else DEFAULT_SIZES; none above
    max_num_seqs."""
    top = max(1, max_num_seqs)
    if configured is not None:
        return tuple(sorted({s for s in configured if 0 < s <= top}))
    return tuple(s for s in DEFAULT_SIZES if s <= top)


def cache_dir_while_compiling(directory: str) -> contextlib.AbstractContextManager:
    """Inductor's caches (FX graphs, compiled kernels) under `directory` while the context is
    open. Inductor takes the location only from TORCHINDUCTOR_CACHE_DIR, read whenever it
    compiles (torch._inductor.runtime.cache_dir_utils.cache_dir), so this is torch's own
    temporary_cache_dir: it sets the variable for the compile and restores the process's
    value afterwards, the engine's configuration never left in its environment."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    os.makedirs(directory, exist_ok=True)
    return temporary_cache_dir(directory)


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _decode_step(model, input_ids, positions, kv_caches, meta):
    return model.compute_logits(model(input_ids, positions, kv_caches, meta))


def _fresh_function(function: types.FunctionType, tag: str) -> types.FunctionType:
    """A copy of `function` with its own code object. Dynamo keeps compiled graphs (and their
    recompile limit) per code object: a runner's graphs must neither count against nor be
    kept alive by those of an earlier runner in the same process."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{tag}")
    return types.FunctionType(code, function.__globals__, code.co_name)


class CompiledDecodeRunner(BucketedDecodeRunner):
    """ModelRunner whose decode-only steps run compiled graphs (see the module docstring).
    `disabled_reason`: why it must stay eager (None: compile at warm-up)."""

    def __init__(self, model: torch.nn.Module, backend: Backend, kv_caches: list[torch.Tensor], block_size: int,
                 *, sizes: tuple[int, ...], max_model_len: int, options: CompileOptions,
                 disabled_reason: str | None = None):
        super().__init__(model, backend, kv_caches, block_size)
        self.max_model_len, self.options = max_model_len, options
        self.sizes = sizes if disabled_reason is None else ()
        self.disabled_reason = disabled_reason if sizes else (disabled_reason or "no batch sizes to compile")
        self.compile_seconds: dict[int, float] = {}
        self.cache_hits = 0
        self.num_compiled_steps = 0
        self._graphs: dict[int, object] = {}
        if self.disabled_reason is None:
            self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), block_size,
                                         backend.device, pin=False)

    @property
    def compiled_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @torch.inference_mode()
    def compile(self) -> None:
        """Compiles (or loads from the cache) and runs once every bucket's graph, on padding rows
        only; any failure leaves every step eager, with the reason logged."""
        if self.disabled_reason is not None:
            logger.info("CPU decode graphs off: %s", self.disabled_reason)
            return
        step = torch.compile(_fresh_function(_decode_step, f"{id(self):x}"), fullgraph=True, dynamic=False)
        self.buffers.pad_all()
        graphs = {}
        try:
            with self._settings():
                for batch in self.sizes:
                    hits = _cache_counts()[0]
                    began = time.perf_counter()
                    run = self._bucket_fn(step, batch)
                    run()
                    self.compile_seconds[batch] = time.perf_counter() - began
                    self.cache_hits += _cache_counts()[0] - hits
                    graphs[batch] = run
        except Exception as error:  # an unsupported op, a compiler error, a missing fake kernel
            self.disabled_reason = f"compilation failed ({type(error).__name__}: {_first_line(error)})"
            logger.warning("CPU decode graphs off, every step runs eager: %s", self.disabled_reason)
            return
        self._graphs = graphs
        logger.info("CPU decode graphs for batch sizes %s in %.1f s (%s; %s; cache %s)",
                    ", ".join(map(str, self.sizes)), sum(self.compile_seconds.values()),
                    ", ".join(f"{b}: {s:.1f} s" for b, s in self.compile_seconds.items()),
                    f"{self.cache_hits} graph(s) from the cache" if self.cache_hits else "all compiled",
                    self.options.cache_dir)

    def _settings(self) -> contextlib.ExitStack:
        """Compiler settings while the buckets compile (each graph compiles on its first call):
        the cache directory, freezing, the FX-graph cache. Dynamo reads `freezing` while
        tracing, so it is set here, not as a torch.compile option; dynamo keeps one graph per
        bucket (its default limit is 8 per function) and raises rather than silently running
        eager past its limit."""
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        stack = contextlib.ExitStack()
        stack.enter_context(cache_dir_while_compiling(self.options.cache_dir))
        stack.enter_context(inductor_config.patch(freezing=self.options.freezing, cpp_wrapper=self.options.cpp_wrapper,
                                                  fx_graph_cache=True))
        stack.enter_context(dynamo_config.patch(recompile_limit=max(dynamo_config.recompile_limit, len(self.sizes)),
                                                fail_on_recompile_limit_hit=True))
        return stack

    def _bucket_fn(self, step, batch: int):
        meta = self.buffers.meta(batch, self.max_model_len)
        input_ids, positions = self.buffers.tokens[0, :batch], self.buffers.tokens[1, :batch]
        model, kv_caches = self.model, self.kv_caches
        return lambda: step(model, input_ids, positions, kv_caches, meta)

    def ready_sizes(self) -> tuple[int, ...]:
        return self.compiled_sizes

    def run_bucket(self, batch: int) -> torch.Tensor:
        self.num_compiled_steps += 1
        return self._graphs[batch]()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else "no message")[:300]
