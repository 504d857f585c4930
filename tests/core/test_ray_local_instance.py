"""`--distributed-executor-backend ray` without a Ray cluster (issue 38): with the default
`--ray-address auto` and no cluster running, the engine starts a local Ray instance on
127.0.0.1 and says so in one log line, as vLLM starts one; an explicit address that does not
answer is one line at once (Ray itself retries it for minutes).

The local instance is started in a subprocess whose Ray finds no cluster: no RAY_ADDRESS, and
a Ray temporary directory of its own (where `ray start` records its cluster), so a cluster
another test or user runs on this machine is not found. Nothing sets Ray's loopback switch
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) for it: binding 127.0.0.1 is the launcher's doing."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from switchyard.core.config import ParallelConfig

# Ray is not imported here: test_ray_shards.py sets how Ray resolves loopback before its import.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="Ray is an optional extra: pip install 'switchyard[ray]'")

LOCAL_START = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
import ray
from switchyard.core.config import ParallelConfig
from switchyard.core.shards.distributed import plan_node
from switchyard.core.shards.ray_launcher import ray_shard_launcher


def idle(shard):
    pass


parallel = ParallelConfig(tensor_parallel_size=2, executor_backend="ray")  # the default address: auto
group = ray_shard_launcher(parallel, "cpu").start(plan_node(parallel, 29500).workers, idle)
assert group.wait(120) and group.failure() is None, group.failure()
seen = dict(gcs=ray.get_runtime_context().gcs_address, nodes=[n["NodeManagerAddress"] for n in ray.nodes()])
group.stop()
seen["connected_after_stop"] = ray.is_initialized()
print("SEEN " + json.dumps(seen), flush=True)
"""


def _left_behind(marker: str) -> list[str]:
    """Command lines of live processes that name `marker` (the instance's temporary directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                line = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if marker in line:
            found.append(line[:120])
    return found


@pytest.mark.slow  # a Ray instance and one shard actor start
def test_no_cluster_and_the_default_address_start_a_local_instance_on_loopback():
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run([sys.executable, "-c", LOCAL_START], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        started = [line for line in lines if "started a local Ray instance" in line]
        assert len(started) == 1 and started[0].startswith(
            "switchyard.core.shards.ray_launcher: no Ray cluster is running on this machine (--ray-address auto): "
            "started a local Ray instance on 127.0.0.1 with "), done.stdout
        seen = json.loads(next(line for line in lines if line.startswith("SEEN "))[5:])
        assert seen["gcs"].startswith("127.0.0.1:") and set(seen["nodes"]) == {"127.0.0.1"}, seen
        assert seen["connected_after_stop"] is False
        deadline = time.monotonic() + 30
        while _left_behind(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _left_behind(ray_tmp) == []  # the local instance ended with the engine's connection
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_explicit_address_that_does_not_answer_is_one_line_at_once():
    import ray

    from switchyard.core.shards.ray_launcher import RayClusterUnreachable, ray_shard_launcher

    assert not ray.is_initialized()
    address = f"127.0.0.1:{_closed_port()}"
    launcher = ray_shard_launcher(ParallelConfig(tensor_parallel_size=2, executor_backend="ray",
                                                 ray_address=address), "cpu")
    with pytest.raises(RayClusterUnreachable) as refused:
        launcher.connect()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"cannot reach the Ray cluster at {address}: "), message
    assert "leave --ray-address at auto" in message and not ray.is_initialized()
    with pytest.raises(RayClusterUnreachable, match=r"^--ray-address 'head-node' is not HOST:PORT"):
        ray_shard_launcher(ParallelConfig(tensor_parallel_size=2, executor_backend="ray",
                                          ray_address="head-node"), "cpu").connect()
