"""core/shards/distributed.py and core/shards/group.py: collectives over gloo between spawned shard
processes, rendezvous, how a shard's end is reported, stop, and shards outliving no parent."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.backend import shard_cores
from switchyard.core.backend import ShardInfo
from switchyard.core.config import ParallelConfig
from switchyard.core.shards.distributed import OBJECT_BUFFER_BYTES, broadcast_object, init_process_group, plan_node
from switchyard.core.shards.group import ProcessShardLauncher
from switchyard.core.engine.shard_worker import free_port


def _shards(world: int) -> list[ShardInfo]:
    port = free_port("127.0.0.1")
    return [ShardInfo(rank, world, rank, "127.0.0.1", port, world) for rank in range(world)]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")  # a zombie has ended
    except FileNotFoundError:
        return True


def _collectives(shard: ShardInfo, result_dir: str) -> None:
    backend = CpuBackend()
    backend.init_device(shard)  # pins to this shard's cores, joins the gloo group
    comm = backend.communicator()
    rank = shard.rank
    summed = comm.all_reduce(torch.tensor([rank + 1.0, 10.0]))
    gathered = comm.all_gather(torch.full((2, 1), float(rank)), dim=-1)
    broadcast = comm.broadcast(torch.tensor([100.0 + rank]), src=1)
    big = list(range(OBJECT_BUFFER_BYTES))  # needs a second broadcast after the fixed buffer
    objects = [broadcast_object(obj if rank == 0 else None) for obj in (("step", 1), big, None)]
    result = dict(summed=summed.tolist(), gathered=gathered.tolist(), broadcast=broadcast.tolist(),
                  threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)),
                  env=[os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]],
                  objects=[objects[0], objects[1] == big, objects[2]])
    (Path(result_dir) / f"{rank}.json").write_text(json.dumps(result))


def _fail(shard: ShardInfo) -> None:
    if shard.rank == 1:
        raise ValueError("shard 1 failed on purpose")


def _sleep(shard: ShardInfo) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_launcher_runs_collectives_and_object_broadcasts_over_gloo_on_disjoint_cores(tmp_path):
    all_cores = sorted(os.sched_getaffinity(0))
    shards = _shards(2)
    group = CpuBackend().shard_launcher().start(shards, _collectives, (str(tmp_path),))
    assert group.wait(120) and group.failure() is None
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["summed"] == [3.0, 20.0] and result["gathered"] == [[0.0, 1.0], [0.0, 1.0]]
        assert result["broadcast"] == [101.0] and result["objects"] == [["step", 1], True, None]
        assert result["env"] == [str(rank), "2", str(shards[0].master_port)]
        assert result["threads"] == len(shard_cores(all_cores, rank, 2))
    assert results[0]["cores"] == all_cores  # rank 0 (the engine's process) is not pinned ...
    assert results[1]["cores"] == shard_cores(all_cores, 1, 2)  # ... the others keep off its slice


def test_shard_cores_split_disjointly_and_share_round_robin_when_too_few():
    assert [shard_cores(list(range(8)), r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [shard_cores([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]


@pytest.mark.slow
def test_failure_names_the_shard_and_its_last_error():
    group = ProcessShardLauncher().start(_shards(3)[1:], _fail)
    assert group.wait(120)
    assert group.failure() == "Shard 1 terminated: ValueError: shard 1 failed on purpose"
    group.stop()


@pytest.mark.slow
def test_killed_shard_is_reported_and_stop_leaves_nothing_behind():
    group = ProcessShardLauncher().start(_shards(3)[1:], _sleep)
    assert group.failure() is None and not group.wait(0.1)
    os.kill(group.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group.failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.failure() == "Shard 2 terminated: killed by signal SIGKILL"
    group.stop(timeout=5)
    assert all(_gone(pid) for pid in group.pids)


def _join_alone(shard: ShardInfo) -> None:
    init_process_group(shard, "gloo", timeout_s=1.0)


@pytest.mark.slow
def test_rendezvous_with_a_peer_that_never_comes_is_an_error():
    # in a shard process: a failed rendezvous leaves torch.distributed's group numbering
    # advanced, so a later group in the same process would wait on other keys than its peers
    group = ProcessShardLauncher().start(_shards(2)[1:], _join_alone)
    assert group.wait(120)
    assert re.match(r"Shard 1 terminated: \w+: .*(?i:timed? ?out)", group.failure())


_ORPHANING_PARENT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_distributed import _shards, _sleep
    from switchyard.core.shards.group import ProcessShardLauncher
    if __name__ == "__main__":
        group = ProcessShardLauncher().start(_shards(3)[1:], _sleep)
        print(*group.pids, flush=True)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind
""")


@pytest.mark.slow
def test_shards_exit_when_their_parent_dies_abruptly(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_ORPHANING_PARENT.format(tests=str(Path(__file__).parent)))
    parent = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    pids = [int(p) for p in parent.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids)


def test_plan_node_numbers_ranks_as_torchrun():
    plan = plan_node(ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1"), 1234)
    assert [(s.rank, s.local_rank, s.local_world_size) for s in plan.shards] == [(2, 0, 2), (3, 1, 2)]
    assert plan.engine_shard is None and plan.workers == plan.shards
    assert {(s.master_addr, s.master_port, s.world_size) for s in plan.shards} == {("10.0.0.1", 1234, 4)}
    node0 = plan_node(ParallelConfig(tensor_parallel_size=3), 99)
    assert node0.engine_shard.rank == 0 and [s.rank for s in node0.workers] == [1, 2]
    with pytest.raises(ValueError, match="does not split evenly"):
        plan_node(ParallelConfig(tensor_parallel_size=3, nnodes=2), 99)
    with pytest.raises(ValueError, match="node rank 2 is not in 0..1"):
        plan_node(ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2), 99)

