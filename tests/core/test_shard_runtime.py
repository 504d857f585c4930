"""The shard runtime around the engine: a killed shard surfaces as ShardTerminated naming
it and nothing outlives shutdown; a backend that cannot shard is refused; three shards of
the default model; two "nodes" on loopback (a second launcher invocation, node rank 1)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from model_helpers import ReferenceBackend
from switchyard.core import LLM
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.errors import ShardTerminated
from switchyard.core.scheduling.request import Request
from switchyard.core.engine.shard_worker import free_port
from test_shard_engine import GREEDY, PROMPTS, TINY, _restore_pinning, tiny_llama  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return not stat.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return False


def test_a_killed_shard_is_shard_terminated_and_shutdown_leaves_no_process(tiny_llama):
    config = EngineConfig(model=ModelConfig(model=tiny_llama), cache=CacheConfig(block_size=4, num_blocks=64),
                          parallel=ParallelConfig(tensor_parallel_size=2), backend="cpu")
    engine = EngineCore(config)
    pids = engine.shards.group.pids
    try:
        engine.add_request(Request("k", [1, 2, 3], GREEDY))
        engine.step()
        engine.step()
        engine.check_health()  # every shard runs
        os.kill(pids[0], signal.SIGKILL)  # rank 1
        with pytest.raises(ShardTerminated, match="^Shard 1 terminated: killed by signal SIGKILL$"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                engine.step()
    finally:
        engine.shutdown()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(ShardTerminated, match="Shard 1"):
        engine.check_health()


def test_a_backend_without_a_dist_backend_cannot_shard(tiny_llama):
    config = EngineConfig(model=ModelConfig(model=tiny_llama), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="backend 'reference' cannot shard"):
        EngineCore(config, backend=ReferenceBackend())


def test_three_shards_of_the_default_model_give_one_shards_tokens():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    with LLM(quantize="none") as single:  # shards take the GGUF dequantized, so does the one shard
        expected = [r.token_ids for r in single.generate(prompts, GREEDY)]
    with LLM(tensor_parallel_size=3) as sharded:
        assert [r.token_ids for r in sharded.generate(prompts, GREEDY)] == expected


def test_two_nodes_on_loopback_give_one_nodes_tokens(tiny_llama):
    with LLM(tiny_llama, **TINY) as single:
        expected = [r.token_ids for r in single.generate(PROMPTS, GREEDY)]
    port = free_port("127.0.0.1")
    # node 1: only its shard (rank 1), started as a user would, with other cache flags:
    # every rank takes rank 0's config
    node1 = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--model", tiny_llama,
                              "--backend", "cpu", "--num-shard", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        parallel = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port)
        with LLM(tiny_llama, parallel=parallel, **TINY) as node0:
            assert not node0.engine.shards.group.pids  # node 0 runs rank 0 only, in this process
            assert [r.token_ids for r in node0.generate(PROMPTS, GREEDY)] == expected
        log, _ = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0, log  # told to stop by rank 0, not failed
    assert "node 1: started shards [1]" in log and "shard 1 of 2 ready" in log


def test_heads_that_do_not_divide_are_refused_before_any_shard_starts(monkeypatch):
    """SmolLM2 (9 heads, 3 KV heads) on 2 shards: the one-line error, and no process launched."""
    from switchyard.backends.cpu import CpuBackend
    from switchyard.core.params import ValidationError

    launched = []
    monkeypatch.setattr(CpuBackend, "shard_launcher", lambda self: launched.append(self))
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValidationError, match=r"^SmolLM2-135M-Instruct has 9 attention heads and 3 KV heads: "
                                              r"--num-shard 2 does not divide them \(1, 3 and 9 shards do\)$"):
        EngineCore(config, CpuBackend())
    assert launched == []
