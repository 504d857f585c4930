"""The engine's step loop, written once: the same code runs in a thread of the caller's
process (InProcessEngineClient) and in the engine process (ProcessEngineClient).

It applies the owner's commands (engine_messages), steps while there is work, and sends
back one `StepDone` per step (every request's output, the load, the step's stats), a
`LoadChanged` after commands, and `Settled` answers. Between steps, and at least every
`health_interval_s` while idle, it calls `engine.check_health()`; a `ShardTerminated`
from there or from a step is fatal (`Dead`, then the loop ends), any other step error
fails the requests in flight (`StepFailed`) and the loop goes on."""
from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from collections.abc import Callable
from typing import TYPE_CHECKING

from .channel import Channel
from .messages import (Abort, AddRequests, CompileGrammar, Dead, EngineLoad, LoadChanged, LoadLora, Ready, Settled,
                              StartupFailed, StepDone, StepFailed, StepStats, Stop, UnloadLora, portable)
from ..errors import BackendError, EngineDeadError, ShardTerminated
from ..memory import release_freed_memory, trim_heap
from ..text.chat_template import sample_turn
from ..text.serving_tokenizer import gateway_tokenizer
from .output_processor import OutputProcessor
from ..scheduling.request import FinishReason, Request
from ..tracing import EngineTracer

if TYPE_CHECKING:
    from ..config import TracingConfig

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.5
# Idle this long after a step, the heap's free pages go back to the OS (core/memory.py trim_heap):
# a CPU engine keeps its activations' pages on the heap between steps (backends/cpu/runtime.py),
# which back-to-back requests reuse, but an idle server should not hold its last peak.
IDLE_TRIM_S = 5.0
ADAPTER_READ_POLL_S = 0.005  # while idle with an adapter being read beside (EngineLoop._lora)


def serve_engine(channel: Channel, engine_factory: Callable[[], tuple[object, object]],
                 warm_up: bool = True, tracing: TracingConfig | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
    """Build the engine (`engine_factory() -> (EngineCore, tokenizer)`), warm it up, say
    `Ready` (or `StartupFailed`), then run the loop until `Stop` or the owner goes away.
    With `tracing` on, the loop exports the engine's spans (core/tracing.py). `on_ready` runs
    once warmed up, before `Ready` is said."""
    try:
        engine, tokenizer = engine_factory()
    except BackendError as exc:  # the configuration does not fit this backend (e.g. its KV cache): one line
        logger.error("engine start-up refused: %s", exc)
        channel.send(StartupFailed(portable(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the owner, which exits
        logger.exception("engine start-up failed")
        channel.send(StartupFailed(portable(exc)))
        return
    try:
        tracer = EngineTracer.start(tracing) if tracing is not None and tracing.enabled else None
    except BaseException as exc:  # noqa: BLE001 - e.g. an unsupported OTLP protocol: a start-up error
        logger.error("engine tracing could not start: %s", exc)
        channel.send(StartupFailed(portable(exc)))
        engine.shutdown()
        return
    loop = EngineLoop(channel, engine, tokenizer, tracer=tracer)
    try:
        if warm_up:
            loop.warm_up()
        release_freed_memory()  # what loading freed stays resident otherwise (core/memory.py)
        if on_ready is not None:
            on_ready()  # e.g. back to the normal CPU priority (core/engine/priority.py)
        channel.send(Ready(engine.info, gateway_tokenizer(tokenizer), loop.load()))
    except BaseException as exc:  # noqa: BLE001
        logger.exception("engine warm-up failed")
        channel.send(StartupFailed(portable(exc)))
        engine.shutdown()
        if tracer is not None:
            tracer.shutdown()
        return
    logger.info("engine warmed up and ready")
    loop.run()


WARM_UP_PROMPT_TOKENS = 40  # about a short chat turn with its template
WARM_UP_TURNS = ("Warm-up 1.", "Warm-up 2.")  # the contents of the two warm-up chat turns


class EngineLoop:
    def __init__(self, channel: Channel, engine, tokenizer, health_interval_s: float = HEALTH_INTERVAL_S,
                 tracer: EngineTracer | None = None):
        self.channel = channel
        self.tracer = tracer  # None: tracing off, nothing is timed or recorded
        self.engine = engine
        self.health_interval_s = health_interval_s
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, engine.finish_request)
        self._request_ids: set[str] = set()  # added and not yet finished or aborted
        # LoRA adapters read beside the steps (_lora): the reader, and the reads it finished
        self._adapter_reader: ThreadPoolExecutor | None = None
        self._adapters_read: queue.SimpleQueue[tuple[LoadLora, Future]] = queue.SimpleQueue()
        self._adapter_reads = 0  # submitted, not yet served or refused
        self._last_step: float | None = None  # monotonic end of the last step not yet followed by a trim

    def warm_up(self) -> None:
        """What the first requests would pay is paid here, before Ready: a step of two prompts
        side by side, then their decodes, and the allocations of both (the shapes a first request
        meets; measured by benchmarks/first_requests.py). The prompts are chat turns rendered by the
        model's template where it has one, so the template's head is in the prefix cache as the
        tenth request finds it; else WARM_UP_PROMPT_TOKENS of text."""
        from ..params import SamplingParams
        from ..pooling.params import PoolingParams
        from ..scheduling.request import pooling_request

        for i, prompt in enumerate(self._warm_up_prompts()):
            if self.engine.info.pooling is not None:  # an embedding model: two prompts pooled side by side
                self.engine.add_request(pooling_request(f"warm-up-{i}", prompt, PoolingParams()))
                continue
            self.engine.add_request(Request(f"warm-up-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                                   ignore_eos=True)))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _warm_up_prompts(self) -> list[list[int]]:
        """Two distinct prompts about a chat turn long, within the model's length: two turns the
        model's template renders where it has one (not for an embedding model), else text."""
        limit = max(1, self.engine.info.max_model_len - 8)
        if self.engine.info.pooling is None:
            turns = [sample_turn(self.tokenizer, content) for content in WARM_UP_TURNS]
            if all(turns):
                return [self.tokenizer.encode(turn, add_special_tokens=False)[:limit] for turn in turns]
        length = min(WARM_UP_PROMPT_TOKENS, limit)
        words = ((self.tokenizer.encode("Warm-up") or [0]) * length)[:length]
        return [words, words[:max(1, length - 8)]]

    def run(self) -> None:
        """Until Stop or the owner's end closes; always stops the engine's workers and shards."""
        try:
            while self._apply_commands(self._idle_wait()):
                self._serve_adapters_read()
                self.engine.check_health()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._release_when_idle(time.monotonic())
        except ShardTerminated as exc:
            logger.error("%s", exc)
            self.channel.send(Dead(portable(exc)))
        except BaseException as exc:  # noqa: BLE001 - the loop itself failed: fatal, said loudly
            logger.exception("the engine loop failed")
            self.channel.send(Dead(portable(exc)))
        finally:
            if self._adapter_reader is not None:
                self._adapter_reader.shutdown(wait=False, cancel_futures=True)
            self.engine.shutdown()
            if self.tracer is not None:
                self.tracer.shutdown()  # flushes the last spans to the collector

    def load(self) -> EngineLoad:
        scheduler = self.engine.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        return EngineLoad(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                          num_kv_blocks_used=pool.num_usable_blocks - pool.num_free_blocks,
                          num_kv_blocks_total=pool.num_usable_blocks)

    def _release_when_idle(self, now: float) -> bool:
        """IDLE_TRIM_S after the last step (once per busy spell), the heap's free pages go back to
        the OS; True when they did."""
        if self._last_step is None or self.engine.has_unfinished_requests() or now - self._last_step < IDLE_TRIM_S:
            return False
        trim_heap()
        self._last_step = None
        return True

    # -- commands -----------------------------------------------------------------------
    def _idle_wait(self) -> float:
        """How long to wait for a command before going on: not at all while requests run, briefly
        while an adapter is being read (to serve it soon), else up to the health interval."""
        if self.engine.has_unfinished_requests():
            return 0.0
        return ADAPTER_READ_POLL_S if self._adapter_reads else self.health_interval_s

    def _apply_commands(self, timeout: float) -> bool:
        """Apply every queued command (waiting up to `timeout` for the first); False once asked
        to stop or the owner is gone."""
        applied = False
        while True:
            try:
                command = self.channel.recv(timeout)
            except EOFError:
                logger.info("the engine's owner went away; stopping")
                return False
            if command is None:
                break
            if isinstance(command, Stop):
                return False
            self._apply(command)
            applied = True
            timeout = 0
        if applied:
            self.channel.send(LoadChanged(self.load()))
        return True

    def _apply(self, command) -> None:
        if isinstance(command, AddRequests):
            self._add(command)
        elif isinstance(command, Abort):
            self._abort(command.request_id)
        elif isinstance(command, CompileGrammar):
            self._compile(command)
        elif isinstance(command, (LoadLora, UnloadLora)):
            self._lora(command)
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _add(self, command: AddRequests) -> None:
        added: list[str] = []
        try:
            for request in command.requests:
                self.engine.add_request(request)
                added.append(request.request_id)
                self._request_ids.add(request.request_id)
                self.processor.add_request(request)
                if self.tracer is not None:
                    self.tracer.add(request, time.time_ns())
        except Exception as exc:  # noqa: BLE001 - handed to the caller; all or none
            for request_id in added:
                self._abort(request_id)
            self.channel.send(Settled(command.token, portable(exc)))
            return
        self.channel.send(Settled(command.token, None))

    def _abort(self, request_id: str) -> None:
        if request_id in self._request_ids:
            self._request_ids.discard(request_id)
            self.engine.finish_request(request_id, FinishReason.ABORT)
            self.processor.remove_request(request_id)
            if self.tracer is not None:
                self.tracer.end(request_id, time.time_ns(), FinishReason.ABORT.value)

    def _lora(self, command: LoadLora | UnloadLora) -> None:
        """Load or unload a LoRA adapter (core/lora/manager.py); a bad adapter or an unknown name
        is the caller's error and changes nothing. While requests run, a load's files are read and
        checked on a thread of their own, so the streams in flight do not wait for the disk
        (benchmarks/lora_swap.py measures their gaps); the adapter is served between steps."""
        if isinstance(command, LoadLora) and self.engine.has_unfinished_requests():
            if self._adapter_reader is None:
                self._adapter_reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            self._adapter_reads += 1
            future = self._adapter_reader.submit(self.engine.read_lora, command.name, command.path)
            future.add_done_callback(lambda done: self._adapters_read.put((command, done)))
            return
        self._settle(command.token, lambda: self.engine.load_lora(command.name, command.path)
                     if isinstance(command, LoadLora) else self.engine.unload_lora(command.name))

    def _serve_adapters_read(self) -> None:
        """Between steps: serve the adapters read since the last step (or answer their refusal)."""
        while self._adapter_reads:
            try:
                command, read = self._adapters_read.get_nowait()
            except queue.Empty:
                return
            self._adapter_reads -= 1
            self._settle(command.token, lambda: self.engine.serve_lora(read.result()))

    def _settle(self, token: int, action: Callable[[], object]) -> None:
        """Run `action` and answer the command `token` with its error (None when it worked)."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            self.channel.send(Settled(token, portable(exc)))
            return
        self.channel.send(Settled(token, None))

    def _compile(self, command: CompileGrammar) -> None:
        """On the engine's grammar workers; answered from their thread when done."""
        def settle(future) -> None:
            error = EngineDeadError("the grammar compile was cancelled") if future.cancelled() else future.exception()
            self.channel.send(Settled(command.token, None if error is None else portable(error)))

        self.engine.grammar_service.compile(command.spec).add_done_callback(settle)

    # -- steps ----------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            self._run_step()
        finally:
            self._last_step = time.monotonic()

    def _run_step(self) -> None:
        start = time.perf_counter()
        start_ns = time.time_ns() if self.tracer is not None else 0
        try:
            outputs = self.processor.process(self.engine.step())
        except ShardTerminated:
            raise
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            logger.exception("engine step failed; failing the requests in flight")
            failed = tuple(self._request_ids)
            for request_id in failed:
                self._abort(request_id)
            self.channel.send(StepFailed(failed, portable(exc), self.load()))
            return
        for i, out in enumerate(outputs):
            if out.finished:
                self._request_ids.discard(out.request_id)
            if out.error is not None:
                outputs[i] = replace(out, error=portable(out.error))
        if self.tracer is not None:
            self.tracer.step(self.engine.last_scheduler_output, outputs, start_ns, time.time_ns())
        load = self.load()
        self.channel.send(StepDone(tuple(outputs), load, self._step_stats(load, time.perf_counter() - start)))

    def _step_stats(self, load: EngineLoad, duration_s: float) -> StepStats:
        last = self.engine.last_scheduler_output
        scheduled = last.scheduled if last is not None else ()
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        # a decode verifying k proposed tokens (core/spec) computes 1 + k tokens, none of them prompt; a
        # pooling request's one-token prompt (core/pooling) is prompt
        decodes = [s for s in scheduled if (s.num_new_tokens == 1 and not s.pools) or s.num_draft_tokens]
        num_decodes = len(decodes)
        num_decode_tokens = sum(s.num_new_tokens for s in decodes)
        return StepStats(
            load=load, num_scheduled_tokens=num_tokens, num_prefill_tokens=num_tokens - num_decode_tokens,
            num_decodes=num_decodes, duration_s=duration_s,
            num_prefix_queried_tokens=last.num_prefix_queried_tokens if last is not None else 0,
            num_prefix_hit_tokens=last.num_prefix_hit_tokens if last is not None else 0,
            num_spec_proposed_tokens=sum(s.num_draft_tokens for s in scheduled),
            num_spec_accepted_tokens=self.engine.last_num_accepted)
