"""The offline Python API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from .text.chat_template import render_chat
from .config import (CacheConfig, EngineConfig, GrammarConfig, LoraConfig, ModelConfig, ParallelConfig,
                     SchedulerConfig, SpeculativeConfig)
from .engine.core import EngineCore
from .loader import load_hf_tokenizer
from .engine.output_processor import OutputProcessor
from .params import SamplingParams, ValidationError
from .pooling.params import PoolingParams
from .scheduling.request import FinishReason, Request, pooling_request, sequence_seed


TextCallback = Callable[[int, int, str], None]  # (prompt index, sample index, new text)


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason  # the engine's own word (a str enum: "eos", "length", "grammar", ...)
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any


@dataclass(frozen=True)
class GenerationResult:
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.outputs[0].finish_reason


class LLM:
    """`LLM(model=None, backend=None)`: None = the default model / the best usable backend.

    `tensor_parallel_size=N` runs rank 0 in this process and N - 1 shard processes (see
    core/engine/shard_worker.py); `parallel` gives the whole ParallelConfig instead (multi-node).
    `shutdown()` (or leaving a `with LLM(...)` block) stops them; they also end with this process."""

    def __init__(self, model: str | None = None, backend: str | None = None, *, dtype: str = "float32",
                 quantize: str | None = None, load_format: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None, kv_cache_dtype: str = "auto",
                 max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, seed: int = 0, enable_prefix_caching: bool = True,
                 grammar: GrammarConfig | None = None, chat_template: str | None = None,
                 model_impl: str = "auto", trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 parallel: ParallelConfig | None = None, speculative: SpeculativeConfig | None = None,
                 isa: str = "auto", compile_decode: bool = False, quantized_activations: str = "auto",
                 task: str = "auto", pooling: str | None = None, lora: LoraConfig | None = None):
        """`chat_template`: a Jinja file's path or template text, for a model without one.
        `isa`: the instruction-set level the backend's kernels run at (EngineConfig.isa);
        `compile_decode`: run steps the way a server does (EngineConfig.compile_decode);
        `quantized_activations`: EngineConfig.quantized_activations;
        `kv_cache_dtype`: what the KV cache stores (CacheConfig.kv_cache_dtype: auto, int8, fp8_e4m3fn, fp8_e5m2).
        `speculative`: speculative decoding (core/spec), e.g. SpeculativeConfig(num_speculative_tokens=4), or
        with a draft model SpeculativeConfig(num_speculative_tokens=4, method="draft", draft_model=PATH).
        `task`, `pooling`: how the model is served (ModelConfig.task: "generate", "embed" for `embed()`,
        or "auto") and how an embedding model pools (ModelConfig.pooling)."""
        self.config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, quantize=quantize, load_format=load_format, seed=seed,
                              max_model_len=max_model_len, chat_template=chat_template, model_impl=model_impl,
                              trust_remote_code=trust_remote_code, task=task, pooling=pooling),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
                              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
            backend=backend, grammar=grammar or GrammarConfig(),
            parallel=parallel or ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            speculative=speculative or SpeculativeConfig(), isa=isa, compile_decode=compile_decode,
            quantized_activations=quantized_activations, lora=lora or LoraConfig(),
        )
        # transformers' tokenizer, as vLLM's LLM holds (its apply_chat_template and the rest); a
        # server's engine holds the lighter ServingTokenizer where it can (core/engine/process.py)
        self.tokenizer = load_hf_tokenizer(self.config.model)
        self.engine = EngineCore(self.config, tokenizer=self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's shard processes and grammar workers."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 on_text: TextCallback | None = None, lora_name: str | None = None) -> list[GenerationResult]:
        """`on_text(prompt index, sample index, text)`, if given, is called with each piece of
        text as it is decoded (streaming); the results come back at the end either way.
        `lora_name`: the LoRA adapter every prompt runs with (`lora=LoraConfig(...)`, load_lora)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [list(p) if not isinstance(p, str) else self.tokenizer.encode(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(texts, token_lists, params, on_text, lora_name)

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory at `path` as `name` (core/lora)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, on_text: TextCallback | None = None) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [render_chat(self.tokenizer, c, add_generation_prompt) for c in conversations]
        token_lists = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._run(texts, token_lists, params, on_text)

    def embed(self, prompts: str | list[str] | list[list[int]], dimensions: int | None = None,
              normalize: bool | None = None) -> list[list[float]]:
        """One embedding per prompt (text or token ids), for a model served for embeddings
        (`task="embed"`, or one whose files say so): pooled as the model says (core/pooling),
        cut to `dimensions` (Matryoshka models) and normalised as the model or `normalize` says."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt in zip(ids, prompts):
                tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(pooling_request(request_id, tokens, params))
        except ValidationError:  # all or nothing: withdraw the prompts already queued
            for request_id in ids:
                self.engine.finish_request(request_id, FinishReason.ABORT)
            raise
        embeddings: dict[str, list[float]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.embedding is not None:
                    embeddings[out.request_id] = out.embedding.tolist()
        return [embeddings[request_id] for request_id in ids]

    def _run(self, texts: list[str | None], token_lists: list[list[int]],
             params: SamplingParams | list[SamplingParams] | None,
             on_text: TextCallback | None = None, lora_name: str | None = None) -> list[GenerationResult]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ValidationError("one SamplingParams per prompt, or a single one", "params")
        processor = OutputProcessor(self.tokenizer, self.engine.finish_request)
        children: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, sample index)
        try:
            for i, (ids, p) in enumerate(zip(token_lists, params_list)):
                if not ids:
                    raise ValidationError("prompt must not be empty", "prompt")
                for j in range(p.n):
                    child = replace(p, n=1, seed=None if p.seed is None else sequence_seed(p.seed, j))
                    # the n samples of a prompt share its KV blocks, even with prefix caching off
                    request = Request(f"offline-{next(self._ids)}", ids, child, share_group=f"offline-prompt-{i}",
                                      lora_name=lora_name)
                    self.engine.add_request(request)
                    processor.add_request(request)
                    children[request.request_id] = (i, j)
        except ValidationError:  # all or nothing: withdraw the prompts already queued
            for request_id in children:
                self.engine.finish_request(request_id, FinishReason.ABORT)
            raise
        collected = {rid: {"text": [], "ids": [], "reason": None} for rid in children}
        while self.engine.has_unfinished_requests():
            for out in processor.process(self.engine.step()):
                if out.error is not None:  # e.g. a grammar that did not compile: withdraw the rest
                    for request_id in children:
                        self.engine.finish_request(request_id, FinishReason.ABORT)
                    raise out.error
                entry = collected[out.request_id]
                entry["text"].append(out.new_text)
                if on_text is not None and out.new_text:
                    on_text(*children[out.request_id], out.new_text)
                entry["ids"].extend(out.new_token_ids)
                if out.finished:
                    entry["reason"] = out.finish_reason
        return self._assemble(texts, token_lists, params_list, children, collected)

    @staticmethod
    def _assemble(texts, token_lists, params_list, children, collected) -> list[GenerationResult]:
        outputs: list[list[CompletionOutput | None]] = [[None] * p.n for p in params_list]
        for rid, (i, j) in children.items():
            entry = collected[rid]
            reason: FinishReason = entry["reason"]
            stop_reason = None
            if reason is FinishReason.STOP_TOKEN:
                stop_reason = entry["ids"][-1]
            outputs[i][j] = CompletionOutput(j, "".join(entry["text"]), tuple(entry["ids"]),
                                             reason, stop_reason)
        return [GenerationResult(texts[i], tuple(token_lists[i]), tuple(outs)) for i, outs in enumerate(outputs)]
