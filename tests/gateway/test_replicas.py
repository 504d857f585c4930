"""Data-parallel replicas (gateway/replicas.py): the router and core split alone (fast), then
`switchyard serve --data-parallel-size 2` as a user runs it: prefix affinity, metrics summed
and per replica, and a replica killed mid-stream (its stream gets an error event, the other
finishes, it is restarted and serves again, nothing is left behind)."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from switchyard.core.config import EngineConfig, ParallelConfig
from switchyard.core.params import ValidationError
from switchyard.gateway.replicas import (PrefixRouter, RoutingPolicy, block_hashes, replica_configs, replica_set,
                                         split_cpus)
from test_engine_process_serve import _children, _gone, _loads_torch
from test_serve import _start, _wait_healthy


# -- the parts, fast ---------------------------------------------------------------------------------
def test_cpus_are_split_into_disjoint_contiguous_sets():
    assert split_cpus([3, 0, 1, 2, 4], 2) == [(0, 1, 2), (3, 4)]
    assert split_cpus([0, 1], 2) == [(0,), (1,)]
    with pytest.raises(ValidationError, match="at least 3 CPUs"):
        split_cpus([0, 1], 3)
    configs = replica_configs(EngineConfig(), 2, cpus=[0, 1, 2, 3])
    assert [c.parallel.cpus for c in configs] == [(0, 1), (2, 3)]
    assert configs[0].model == EngineConfig().model


def test_block_hashes_name_whole_blocks_and_chain():
    prompt = list(range(40))
    hashes = block_hashes(prompt, 16, 64)
    assert len(hashes) == 2  # 40 tokens: two full blocks, the rest is not cacheable
    assert block_hashes(prompt[:32] + [999] * 8, 16, 64) == hashes
    assert block_hashes([7] + prompt[1:], 16, 64)[1] != hashes[1]  # chained: block 1 depends on block 0
    assert block_hashes(prompt, 16, 64, salt="tenant")[0] != hashes[0]
    assert len(block_hashes(list(range(1000)), 16, 4)) == 4


def test_cache_aware_routing_follows_the_prefix_within_a_load_bound():
    router = PrefixRouter(RoutingPolicy(load_slack=2, load_ratio=2.0))
    system_a, system_b = list(range(64)), list(range(100, 164))
    first = router.choose(system_a + [1, 2], {0: 0, 1: 0})
    assert first == 0
    assert router.choose(system_a + [3, 4, 5], {0: 1, 1: 0}) == 0  # its prefix is on 0, within the bound
    assert router.choose(system_b + [1], {0: 2, 1: 0}) == 1  # a new prefix: the least loaded
    assert router.choose(system_b + [9] * 20, {0: 0, 1: 2}) == 1
    # a hot prefix past the bound (least + slack and 2 x least) spills to the least loaded, which holds it too
    assert router.choose(system_a, {0: 3, 1: 0}) == 1
    assert router.choose(system_a + [5], {0: 1, 1: 2}) == 0  # both hold it: the less loaded of the two
    assert router.choose(system_a + [6], {0: 2, 1: 1}) == 1
    assert router.choose(system_b, {0: 0, 1: 2}) == 1  # b is on 1 alone: its queue is within the bound
    router.forget(1)  # replica 1 restarted: it holds nothing
    assert router.choose(system_b, {0: 1, 1: 0}) == 1  # b is nobody's: the least loaded
    assert router.choose(system_a, {0: 2, 1: 0}) == 0  # a is on 0 alone now


def test_a_longer_prefix_stays_on_its_replica_under_a_larger_imbalance():
    """The slack grows by one outstanding request per 64 tokens of the known prefix: a miss
    costs that prefix's prefill. A 1,024-token prefix stays under an imbalance of 16; a 16-token
    one (a chat template's first block) spills past 4, so short shared prefixes still spread."""
    router = PrefixRouter(RoutingPolicy())
    system, template = list(range(1024)), list(range(5000, 5016))
    assert router.choose(system + [1], {0: 0, 1: 0}) == 0
    assert router.choose(system + [2], {0: 16, 1: 0}) == 0
    assert router.choose(system + [3], {0: 17, 1: 0}) == 1  # past the slack: 1 holds it too
    assert router.choose(system + [4], {0: 17, 1: 3}) == 1  # the less loaded holder
    assert router.choose(template + [1], {0: 0, 1: 0}) == 0
    assert router.choose(template + [2], {0: 4, 1: 0}) == 0
    assert router.choose(template + [3], {0: 5, 1: 0}) == 1


def test_least_load_and_round_robin_ignore_prefixes():
    least = PrefixRouter(RoutingPolicy("least-load"))
    assert [least.choose([1] * 32, loads) for loads in ({0: 1, 1: 0}, {0: 0, 1: 3}, {0: 2, 1: 2})] == [1, 0, 0]
    turns = PrefixRouter(RoutingPolicy("round-robin"))
    assert [turns.choose([1] * 32, {0: 5, 1: 0}) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValidationError, match="--data-parallel-routing"):
        RoutingPolicy("random")


def test_replica_sets_refuse_what_they_cannot_run():
    with pytest.raises(ValidationError, match="at least 1"):
        replica_set(EngineConfig(), 0, "cache-aware", lambda config: None)
    with pytest.raises(ValidationError, match="--nnodes"):
        replica_set(EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2)), 2, "cache-aware",
                    lambda config: None)


# -- switchyard serve --data-parallel-size 2 ------------------------------------------------------------
def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _wait_replicas_up(url: str, n: int, timeout: float = 240, restarts: int = 0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = _metrics(url)
        if (all(metrics.get(f'switchyard_replica_up{{replica="{i}"}}') == 1 for i in range(n))
                and sum(metrics.get(f'switchyard_replica_restarts{{replica="{i}"}}', 0) for i in range(n)) >= restarts):
            return metrics
        time.sleep(0.2)
    raise AssertionError(f"the replicas did not all come up: {metrics}")


def _routed(metrics: dict[str, float]) -> list[float]:
    return [metrics[f'switchyard_replica_routed_requests{{replica="{i}"}}'] for i in range(2)]


def _engine_cpus(server_pid: int) -> dict[int, str]:
    """engine pid -> its Cpus_allowed_list (each replica's own cores)."""
    found = {}
    for pid in _children(server_pid):
        try:
            if "switchyard.core.engine.process" in open(f"/proc/{pid}/cmdline").read() and _loads_torch(pid):
                status = open(f"/proc/{pid}/status").read()
                found[pid] = re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)
        except OSError:
            continue
    return found


SYSTEM = ("You are a careful assistant for a small bookshop. You answer questions about opening hours, "
          "orders, deliveries and returns in two short sentences, politely, and you never invent prices.")


def _chat(url: str, system: str, user: str, max_tokens: int = 4) -> dict:
    body = {"model": "tgi", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two CPUs")
def test_two_replicas_route_by_prefix_sum_metrics_and_survive_a_killed_engine():
    proc, url = _start("--max-batch-total-tokens", "1024", "--data-parallel-size", "2", "--grammar-workers", "1")
    try:
        _wait_healthy(proc, url)
        metrics = _wait_replicas_up(url, 2)
        assert metrics["tgi_batch_max_total_tokens"] == 2 * 1024  # summed over the replicas
        assert not _loads_torch(proc.pid), "the gateway process loaded torch"
        cpus = _engine_cpus(proc.pid)
        assert sorted(cpus.values()) == ["0", "1"], cpus  # one core each, disjoint

        # prefix affinity: one system prompt, three users -> one replica, its prefix cache hit
        for user in ("When do you open?", "Do you deliver?", "Can I return a book?"):
            _chat(url, SYSTEM, user)
        metrics = _metrics(url)
        assert sorted(_routed(metrics)) == [0, 3]
        assert metrics["switchyard_replica_affinity_routed"] == 2
        assert metrics["switchyard_prefix_cache_hit_tokens"] >= 2 * 32
        assert metrics["tgi_request_success"] == 3

        # two streams on the two replicas (the second is a new prefix: the least loaded replica takes it)
        events: dict[str, list[dict]] = {"a": [], "b": []}
        started = {name: threading.Event() for name in events}

        def stream(name: str, prompt: str) -> None:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 400, "details": True}}
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=240) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events[name].append(json.loads(line[5:]))
                        started[name].set()

        before = _routed(_metrics(url))
        readers = {"a": threading.Thread(target=stream, args=("a", "Count slowly from one to a thousand: one,"))}
        readers["a"].start()
        assert started["a"].wait(120)
        middle = _routed(_metrics(url))
        replica_a = [m - b for m, b in zip(middle, before)].index(1)
        readers["b"] = threading.Thread(target=stream, args=("b", "List every country of the world, one per line:"))
        readers["b"].start()
        assert started["b"].wait(120)
        replica_b = [m - b for m, b in zip(_routed(_metrics(url)), middle)].index(1)
        assert {replica_a, replica_b} == {0, 1}

        victim = next(pid for pid, cpu in cpus.items() if cpu == str(replica_b))
        os.kill(victim, signal.SIGKILL)
        readers["b"].join(60)
        assert "error" in events["b"][-1] and "exit code -9" in events["b"][-1]["error"], events["b"][-1]
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # the other replica still serves
        readers["a"].join(240)
        assert "error" not in events["a"][-1] and events["a"][-1]["details"]["finish_reason"] in ("length", "eos_token")

        # the dead replica is restarted and serves again; the server never stopped
        metrics = _wait_replicas_up(url, 2, restarts=1)
        assert metrics[f'switchyard_replica_restarts{{replica="{replica_b}"}}'] == 1
        assert proc.poll() is None
        assert len(_engine_cpus(proc.pid)) == 2 and victim not in _engine_cpus(proc.pid)
        for user in ("Is there parking?", "Do you sell maps?"):  # both replicas serve (least-load spreads them)
            _chat(url, "Answer briefly.", user)
        descendants = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert not _gone(descendants, 15), "processes were left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
