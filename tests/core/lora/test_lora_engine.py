"""The engine's side of LoRA: slots and LRU, the adapter limit per step, requests naming unknown
adapters, the prefix cache per adapter, and LoadLora / UnloadLora through the engine loop."""
from __future__ import annotations

import time

import pytest
from lora_helpers import GREEDY, LogitsRecorder, make_adapter, make_engine, prompts, reference_greedy, run

from switchyard.core.engine.loop import EngineLoop
from switchyard.core.engine.messages import AddRequests, LoadLora, Settled, UnloadLora
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.scheduling.request import Request


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Four adapters (a..d) of ranks 2..5 and their merged references."""
    root = tmp_path_factory.mktemp("adapters")
    merged = {name: make_adapter(llama_dir, root / name, seed=20 + i, r=2 + i) for i, name in enumerate("abcd")}
    return {name: str(root / name) for name in "abcd"}, merged


def test_two_slots_serve_four_adapters_lru_and_at_most_two_a_step(llama_dir, adapters):
    paths, merged = adapters
    engine = make_engine(llama_dir, adapters=list(paths.items()), max_loras=2)
    per_step = []

    def count(engine):
        scheduled = engine.last_scheduler_output.scheduled
        per_step.append({s.lora_name for s in scheduled if s.lora_name is not None})
        assert len(engine.lora.resident) <= 2

    requests = [(f"r-{n}", p, n) for n, p in zip("abcd", prompts(count=4))]
    tokens = run(engine, requests, on_step=count)
    assert max(len(s) for s in per_step) == 2 and set().union(*per_step) == set("abcd")
    for rid, prompt, name in requests:
        assert tokens[rid] == reference_greedy(merged[name], prompt, len(tokens[rid])), rid
    # the least recently used resident adapter is the one evicted
    assert engine.lora.resident == ("c", "d")
    run(engine, [("again-a", requests[0][1], "a")])
    assert engine.lora.resident == ("d", "a")
    run(engine, [("again-d", requests[3][1], "d")])
    assert engine.lora.resident == ("a", "d")


def test_a_request_waiting_for_an_adapter_slot_is_not_overtaken_by_other_adapters(llama_dir, adapters):
    """max_loras=1: a's requests run; b waits; a later request of a waits behind b (no starvation),
    a request of the base model passes."""
    paths, _ = adapters
    engine = make_engine(llama_dir, adapters=list(paths.items()), max_loras=1)
    long = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    p = prompts(count=1)[0]
    engine.add_request(Request("a1", p, long, lora_name="a"))
    engine.step()
    engine.add_request(Request("b1", p, long, lora_name="b"))
    engine.add_request(Request("a2", p, long, lora_name="a"))
    engine.add_request(Request("base", p, long))
    admitted = []
    while engine.has_unfinished_requests():
        engine.step()
        running = [r.request_id for r in engine.scheduler.running]
        admitted.extend(rid for rid in running if rid not in admitted)
        assert len({r.lora_name for r in engine.scheduler.running if r.lora_name}) <= 1
    assert admitted.index("base") < admitted.index("b1") < admitted.index("a2")


def test_unknown_adapter_is_refused_and_the_others_run(llama_dir, adapters):
    paths, merged = adapters
    engine = make_engine(llama_dir, adapters=[("a", paths["a"])])
    p = prompts(count=1)[0]
    engine.add_request(Request("ok", p, GREEDY, lora_name="a"))
    with pytest.raises(ValidationError, match="LoRA adapter 'nope' is unknown"):
        engine.add_request(Request("bad", p, GREEDY, lora_name="nope"))
    tokens = run(engine, [])
    assert set(tokens) == {"ok"}
    assert tokens["ok"] == reference_greedy(merged["a"], p, len(tokens["ok"]))


def test_adapter_names_without_lora_are_refused(llama_dir):
    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
    from switchyard.core.engine.core import EngineCore

    engine = EngineCore(EngineConfig(model=ModelConfig(model=llama_dir), cache=CacheConfig(block_size=4, num_blocks=32),
                                     backend="cpu"))
    assert engine.info.lora_adapters is None
    with pytest.raises(ValidationError, match="not served"):
        engine.add_request(Request("x", [1, 2, 3], GREEDY, lora_name="a"))


def test_the_prefix_cache_is_not_shared_across_adapters_or_loads(llama_dir, adapters):
    paths, _ = adapters
    engine = make_engine(llama_dir, adapters=[("a", paths["a"]), ("b", paths["b"])])
    prompt = list(range(2, 22))  # five full blocks of 4

    def cached(rid, name):
        engine.add_request(Request(rid, prompt, GREEDY, lora_name=name))
        request = engine.scheduler.get_request(rid)
        run(engine, [])
        return request.num_cached_tokens

    assert cached("a1", "a") == 0
    assert cached("a2", "a") == 19  # the same adapter: its cached tokens, all but the last (3 copied)
    assert cached("b1", "b") == 0  # another adapter: none of a's
    assert cached("base1", None) == 0  # the base model: none either
    engine.unload_lora("a")
    engine.load_lora("a", paths["c"])  # the same name, other weights: a new load
    assert cached("a3", "a") == 0


class RecordingChannel:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def recv(self, timeout):
        return None

    def close(self):
        pass


def test_load_and_unload_through_the_engine_loop(llama_dir, adapters, tmp_path):
    paths, merged = adapters
    engine = make_engine(llama_dir)  # --enable-lora, no adapter at start
    assert engine.info.lora_adapters == ()
    loop = EngineLoop(RecordingChannel(), engine, tokenizer=None)

    def settle(command):
        loop._apply(command)
        while not loop.channel.sent:  # a load while requests run is read beside the steps
            time.sleep(0.005)
            loop._serve_adapters_read()
        answer = loop.channel.sent.pop()
        assert isinstance(answer, Settled) and answer.token == command.token
        return answer.error

    assert settle(LoadLora(1, "a", paths["a"])) is None
    assert "already loaded" in str(settle(LoadLora(2, "a", paths["b"])))
    assert "not loaded" in str(settle(UnloadLora(3, "zzz")))
    assert "does not exist" in str(settle(LoadLora(4, "x", str(tmp_path / "missing"))))
    assert engine.lora.names == ("a",)
    assert "'zzz' is unknown" in str(settle(AddRequests(8, (Request("z", [1, 2, 3], GREEDY, lora_name="zzz"),))))
    assert not engine.has_unfinished_requests()

    # unloading an adapter in use: its request finishes with it, a new one is refused
    p = prompts(count=1)[0]
    engine.add_request(Request("running", p, GREEDY, lora_name="a"))
    first = [t for out in engine.step() for t in out.new_token_ids]
    assert settle(UnloadLora(5, "a")) is None
    with pytest.raises(ValidationError, match="LoRA adapter 'a' was unloaded"):
        engine.add_request(Request("new", p, GREEDY, lora_name="a"))
    assert "being unloaded" in str(settle(LoadLora(6, "a", paths["b"])))
    # a load while a request runs: read on the loop's reader thread, answered (served) between
    # steps, and the steps go on meanwhile
    loop._apply(LoadLora(9, "b", paths["b"]))
    assert loop.channel.sent == [] and loop._adapter_reads == 1
    first += [t for out in engine.step() for t in out.new_token_ids]
    while loop._adapter_reads:
        time.sleep(0.005)
        loop._serve_adapters_read()
    assert loop.channel.sent.pop() == Settled(9, None) and "b" in engine.lora.names
    tokens = first + run(engine, [])["running"]
    assert tokens == reference_greedy(merged["a"], p, len(tokens))
    assert "a" not in engine.lora.retiring and engine.lora.resident == ()  # dropped with its last request
    assert settle(LoadLora(7, "a", paths["b"])) is None  # the name is free again


def test_an_unloaded_adapter_in_use_gives_the_same_tokens(llama_dir, adapters):
    paths, merged = adapters
    engine = make_engine(llama_dir, adapters=[("a", paths["a"])])
    p = prompts(count=1)[0]
    engine.add_request(Request("r", p, GREEDY, lora_name="a"))
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    engine.unload_lora("a")
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference_greedy(merged["a"], p, len(tokens))
    assert engine.lora.retiring == {}


def test_steps_without_adapter_rows_leave_the_wrappers_idle(llama_dir, adapters):
    """A base-model step gets no LoraBatch: every wrapped layer is its base layer."""
    paths, _ = adapters
    engine = make_engine(llama_dir, adapters=[("a", paths["a"])])
    calls = []
    kernel = engine.lora.context.kernel
    original = kernel.shrink
    engine.lora.context.kernel.shrink = lambda *args: calls.append(1) or original(*args)
    recorder = LogitsRecorder(engine)
    run(engine, [("base", prompts(count=1)[0], None)])
    assert calls == [] and recorder.rows["base"]
    run(engine, [("lora", prompts(count=1)[0], "a")])
    assert calls
