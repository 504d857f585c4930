"""The engine out of process (core/engine/process.py) and the one step loop both clients
share (core/engine/loop.py): errors cross as their own types, a dead engine fails its
streams at once and turns /health to 503, a terminated shard is fatal, no process is left."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.engine.process import ProcessEngineClient
from switchyard.core.errors import EngineDeadError, ShardTerminated
from switchyard.core.grammar import GrammarError, GrammarSpec
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import Request
from switchyard.gateway.app import health_response

TINY = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"), cache=CacheConfig(num_blocks=64))


def _request(request_id: str, max_tokens: int = 4, **params) -> Request:
    return Request(request_id, [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True, **params))


async def _collect(stream) -> list:
    return [out async for out in stream]


def _tiny_factory():
    from switchyard.core.engine.process import build_engine

    return build_engine(TINY)


@pytest.fixture
def process_client():
    client = ProcessEngineClient(TINY)
    client.start()
    yield client
    asyncio.run(client.shutdown())
    assert client.process.poll() is not None


@pytest.mark.slow
def test_the_process_engine_serves_and_its_errors_keep_their_types(process_client):
    async def run():
        await process_client.wait_ready(timeout=600)
        assert process_client.info.num_kv_blocks == 64 and process_client.load.num_kv_blocks_total == 63
        outs = await _collect(await process_client.add_request(_request("a", 6)))
        assert sum(len(o.new_token_ids) for o in outs) == 6 and outs[-1].finished
        with pytest.raises(ValidationError) as refused:  # raised in the engine process, same type here
            await process_client.add_requests([_request("b"), _request("b")])
        assert "already" in str(refused.value)
        with pytest.raises(GrammarError) as bad:
            await process_client.compile_grammar(GrammarSpec("regex", "(unclosed"))
        assert bad.value.param == "grammar"
        await process_client.compile_grammar(GrammarSpec("regex", "[a-z]+"))
        assert process_client.num_unfinished == 0

    asyncio.run(run())


@pytest.mark.slow
def test_a_killed_engine_process_fails_streams_and_health_at_once(process_client):
    async def run():
        await process_client.wait_ready(timeout=600)
        assert health_response(process_client).status_code == 200
        stream = await process_client.add_request(_request("long", 10_000))
        await stream.__anext__()  # it is generating
        os.kill(process_client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"exit code -9"):
            await asyncio.wait_for(_collect(stream), 30)
        assert not process_client.ready and health_response(process_client).status_code == 503
        assert "exit code -9" in str(await asyncio.wait_for(process_client.wait_failure(), 5))
        with pytest.raises(EngineDeadError):
            await process_client.add_request(_request("after"))

    asyncio.run(run())


def test_a_terminated_shard_is_fatal_and_stops_the_loop():
    """check_health() raising ShardTerminated (what tprun's shard group reports) ends the
    loop with that error; every stream gets it; the engine is shut down."""
    client = InProcessEngineClient(_tiny_factory, warm_up=False)
    client.start()

    async def run():
        await client.wait_ready(timeout=600)
        stream = await client.add_request(_request("s", 10_000))
        await stream.__anext__()
        shut = []
        client.engine.shutdown = lambda: shut.append(True)

        def check_health():
            raise ShardTerminated("Shard 1 terminated: exit code -9")

        client.engine.check_health = check_health
        with pytest.raises(ShardTerminated, match="Shard 1 terminated"):
            await asyncio.wait_for(_collect(stream), 30)
        assert isinstance(await asyncio.wait_for(client.wait_failure(), 5), ShardTerminated)
        assert not client.ready and shut == [True]

    asyncio.run(run())


def test_a_failed_step_fails_the_batch_and_keeps_serving():
    client = InProcessEngineClient(_tiny_factory, warm_up=False)
    client.start()

    async def run():
        await client.wait_ready(timeout=600)
        step = client.engine.step
        client.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(EngineDeadError, match="generation failed: boom"):
            await asyncio.wait_for(_collect(await client.add_request(_request("x"))), 30)
        client.engine.step = step
        outs = await asyncio.wait_for(_collect(await client.add_request(_request("y"))), 30)
        assert outs[-1].finished and client.failure is None and client.ready
        await client.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_the_engine_process_stops_when_its_gateway_dies():
    """A gateway killed outright leaves no engine behind: the pipe's end-of-file stops it."""
    script = ("import asyncio, sys; from switchyard.core.engine.process import ProcessEngineClient;"
              "from tests.core.test_engine_process import TINY; c = ProcessEngineClient(TINY); c.start();"
              "asyncio.run(c.wait_ready(600)); print(c.process.pid, flush=True); import time; time.sleep(600)")
    gateway = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        engine_pid = int(gateway.stdout.readline())
        gateway.kill()
        gateway.wait(10)
        deadline = time.monotonic() + 30
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its gateway"
            time.sleep(0.1)
    finally:
        if gateway.poll() is None:
            gateway.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_start_up_error_comes_back_as_itself():
    from dataclasses import replace

    from switchyard.core.plugins import BackendError

    client = ProcessEngineClient(replace(TINY, backend="no-such-backend"))
    client.start()
    try:
        with pytest.raises(BackendError, match="no-such-backend"):  # checked with the model, before loading
            client.wait_model_checked(600)
        with pytest.raises(BackendError, match="no-such-backend"):
            asyncio.run(client.wait_ready(600))
        assert client.startup_error is client.failure and not client.ready
    finally:
        asyncio.run(client.shutdown())


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of a process."""
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:
            pass
    return policies


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
@pytest.mark.parametrize("serve_in_background", [False, True])
def test_an_engine_loaded_in_the_background_serves_at_the_priority_it_is_given(serve_in_background):
    """Loaded on demand: at SCHED_IDLE while loading, then every thread back to normal, or (a
    models file's `priority: background`) every thread left at SCHED_IDLE (core/engine/priority.py)."""
    from dataclasses import replace

    config = replace(TINY, start_in_background=True, serve_in_background=serve_in_background)
    client = ProcessEngineClient(config)
    client.start()
    try:
        async def run():
            await client.wait_ready(timeout=600)
            outs = await _collect(await client.add_request(_request("a", 4)))
            assert outs[-1].finished

        asyncio.run(run())
        expected = os.SCHED_IDLE if serve_in_background else os.SCHED_OTHER
        assert _policies(client.process.pid) == {expected}
    finally:
        asyncio.run(client.shutdown())


class _Tokenizer:
    """encode: one id per character; a chat template when given one."""

    special_tokens_map: dict = {}

    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<|system|>Be brief.<|user|>{{ m.content }}{% endfor %}"])
def test_the_warm_up_prompts_are_chat_turns_where_the_model_has_a_template(template):
    """core/engine/loop.py: two distinct prompts within the model's length; with a template they
    are turns it renders (their shared head is what a first request then finds cached), without
    one (a base model) text of WARM_UP_PROMPT_TOKENS."""
    from types import SimpleNamespace

    from switchyard.core.engine import loop as loop_module

    info = SimpleNamespace(max_model_len=32, pooling=None)
    engine = SimpleNamespace(finish_request=lambda *a: None, info=info)
    first, second = loop_module.EngineLoop(None, engine, _Tokenizer(template))._warm_up_prompts()
    assert 0 < len(first) <= 24 and 0 < len(second) <= 24
    if template is None:
        assert "".join(map(chr, first)).startswith("Warm-upWarm-up") and len(second) < len(first)
    else:
        assert "".join(map(chr, first)) == "<|system|>Be brief.<|use"  # rendered, cut at 32 - 8
        info.max_model_len = 4096
        first, second = loop_module.EngineLoop(None, engine, _Tokenizer(template))._warm_up_prompts()
        assert "".join(map(chr, second)) == "<|system|>Be brief.<|user|>Warm-up 2."


def test_the_client_compiles_its_copy_of_the_chat_template_on_ready():
    """core/engine/client.py: on Ready the owner's process compiles the template the gateway will
    render, so the first chat request does not pay for it."""
    from switchyard.core.engine.messages import Ready
    from switchyard.core.text.chat_template import compiled_template

    template = "{% for m in messages %}<|user|>{{ m.content }} (client){% endfor %}"
    compiled_template.cache_clear()
    client = InProcessEngineClient(_tiny_factory)  # never started: only its reader's handling
    client._handle(Ready(info=None, tokenizer=_Tokenizer(template), load=None))
    assert compiled_template.cache_info().currsize == 1 and client.tokenizer.chat_template == template
