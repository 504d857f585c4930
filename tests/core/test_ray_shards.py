"""Shards as Ray actors (core/shards/ray_launcher.py, --distributed-executor-backend ray) on a
simulated two-node Ray cluster on loopback (ray.cluster_utils.Cluster: a head and one more
node): three shards spread over both nodes give one shard's greedy tokens, and a served
model's shard actor killed with ray.kill ends the server non-zero, as SIGTERM ends it cleanly,
with no actor, placement group or process of it left."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

# Ray resolves 127.0.0.1 to the machine's own address when a driver connects; with this it keeps
# loopback, so every Ray process here (GCS, raylets, the drivers, the served engine) binds
# 127.0.0.1 only. Read once, when Ray is imported: set before the import below.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'switchyard[ray]'")

from switchyard.core import LLM  # noqa: E402
from switchyard.core.config import ParallelConfig  # noqa: E402
from test_shard_engine import GREEDY, PROMPTS, TINY, _restore_pinning  # noqa: E402,F401 - fixture

NODE = dict(node_ip_address="127.0.0.1", object_store_memory=100 * 1024 ** 2)


@pytest.fixture(scope="module")
def cluster():
    """A head (2 CPUs) and one more node (1 CPU), both on loopback; this process is a driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False, **NODE))
    cluster.add_node(num_cpus=1, **NODE)
    ray.init(address=cluster.address, namespace="switchyard-tests")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory, default_tokenizer):
    """A random Llama whose 6 heads, 3 KV heads and 96-token vocabulary split over 3 shards."""
    from transformers import LlamaConfig

    from model_helpers import save_tiny

    config = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                         eos_token_id=95, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama-tp3")
    save_tiny(config, path)
    default_tokenizer.save_pretrained(path)
    return str(path)


def _serve_args(*argv: str):
    from switchyard.gateway.cli import build_parser

    return build_parser({}).parse_args(["serve", *argv])


def test_the_flags_reach_the_parallel_config_and_nnodes_is_refused_with_ray():
    from switchyard.core.params import ValidationError
    from switchyard.gateway.serve import engine_config

    parallel = engine_config(_serve_args("--num-shard", "3", "--distributed-executor-backend", "ray",
                                         "--ray-address", "10.0.0.1:6379",
                                         "--ray-placement-strategy", "STRICT_SPREAD")).parallel
    assert (parallel.executor_backend, parallel.ray_address, parallel.ray_placement_strategy) == (
        "ray", "10.0.0.1:6379", "STRICT_SPREAD")
    assert engine_config(_serve_args()).parallel.executor_backend == "mp"
    with pytest.raises(ValidationError, match="drop --nnodes 2"):
        engine_config(_serve_args("--num-shard", "2", "--nnodes", "2", "--distributed-executor-backend", "ray"))


def test_a_backend_without_declared_ray_resources_is_refused_in_one_line():
    from switchyard.core.shards.ray_launcher import resources_for

    assert resources_for("cuda").num_gpus == 1 and resources_for("cpu").num_gpus == 0
    with pytest.raises(ValueError, match="^backend 'tpu' cannot run its shards on Ray"):
        resources_for("tpu")


def test_placed_shards_count_local_ranks_per_node_with_the_engine_first_on_its_own():
    from switchyard.core.shards.distributed import plan_node
    from switchyard.core.shards.ray_launcher import _placed_shards

    workers = plan_node(ParallelConfig(tensor_parallel_size=4), 29500).workers  # ranks 1, 2, 3
    placed = _placed_shards(workers, ["head", "other", "head"], "head", {"head": "10.0.0.1", "other": "10.0.0.2"}.get)
    assert [(s.rank, s.local_rank, s.local_world_size) for s in placed] == [(1, 1, 3), (2, 0, 1), (3, 2, 3)]
    assert {s.master_addr for s in placed} == {"10.0.0.1"} and {s.master_port for s in placed} == {29500}


def _shard_actors() -> list[tuple[str, str]]:
    """(namespace, name) of every live named shard actor in the cluster."""
    return [(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if "-shard-" in a["name"]]


def _live_placement_groups() -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


def _shard_processes() -> list[int]:
    """Ray worker processes running a shard actor (Ray titles them ray::_ShardActor...)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"_ShardActor" in cmdline.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _nothing_left(timeout: float = 30.0) -> tuple[list, list, list]:
    deadline = time.monotonic() + timeout
    while True:
        left = _shard_actors(), _live_placement_groups(), _shard_processes()
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.slow
def test_three_shards_spread_over_two_nodes_give_one_shards_greedy_tokens(cluster, tiny_llama3):
    with LLM(tiny_llama3, **TINY) as single:
        expected = [r.token_ids for r in single.generate(PROMPTS, GREEDY)]
    parallel = ParallelConfig(tensor_parallel_size=3, executor_backend="ray", ray_placement_strategy="STRICT_SPREAD")
    with LLM(tiny_llama3, parallel=parallel, **TINY) as sharded:
        group = sharded.engine.shards.group
        assert len(set(group.node_ids)) == 2  # STRICT_SPREAD: shards 1 and 2 on different nodes
        assert [r.token_ids for r in sharded.generate(PROMPTS, GREEDY)] == expected
        assert all(len(t) == 32 for t in expected)
        assert sorted(name for _, name in _shard_actors()) == sorted(group.actor_names)
    assert _nothing_left() == ([], [], [])


@pytest.mark.slow
def test_shards_the_cluster_cannot_place_fail_the_start_and_leave_no_placement_group(cluster, tiny_llama3,
                                                                                     monkeypatch):
    from switchyard.core.shards import ray_launcher

    monkeypatch.setattr(ray_launcher, "PLACEMENT_TIMEOUT_S", 3.0)
    parallel = ParallelConfig(tensor_parallel_size=6, executor_backend="ray")  # 5 bundles of 1 CPU; 3 CPUs
    with pytest.raises(RuntimeError, match=r"^the Ray cluster did not place 5 shards of \{'CPU': 1\} \(PACK\) "
                                           r"within 3s; it has "):
        LLM(tiny_llama3, parallel=parallel, **TINY)
    assert _nothing_left() == ([], [], [])


def _serve(model: str, address: str) -> tuple[subprocess.Popen, str]:
    """`switchyard serve` of model's 3 shards on the cluster at address, on loopback."""
    import sys

    from switchyard.core.engine.shard_worker import free_port

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1",
                             "--port", str(port), "--model-id", model, "--backend", "cpu", "--enforce-eager",
                             "--num-shard", "3", "--max-batch-total-tokens", "4096",
                             "--distributed-executor-backend", "ray", "--ray-address", address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def _answer_when_healthy(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    else:
        raise AssertionError("server never became healthy")
    answer = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                        timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text


@pytest.mark.slow
def test_a_killed_shard_actor_ends_the_server_non_zero_and_leaves_nothing(cluster, tiny_llama3):
    proc, url = _serve(tiny_llama3, cluster.address)
    try:
        _answer_when_healthy(proc, url)
        actors = _shard_actors()
        assert len(actors) == 2, actors  # ranks 1 and 2; rank 0 is the engine process itself
        namespace, name = next(a for a in actors if a[1].endswith("-shard-2"))
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        assert proc.wait(120) == 1  # non-zero, not its own SIGTERM: a supervisor restarts it
        assert "Shard 2 terminated: its Ray actor died" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _nothing_left() == ([], [], [])


@pytest.mark.slow
def test_sigterm_ends_the_server_and_its_shard_actors_cleanly(cluster, tiny_llama3):
    proc, url = _serve(tiny_llama3, cluster.address)
    try:
        _answer_when_healthy(proc, url)
        assert len(_shard_actors()) == 2
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once drained: "terminated by SIGTERM" is the clean end
        assert proc.wait(120) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "terminated" not in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _nothing_left() == ([], [], [])
