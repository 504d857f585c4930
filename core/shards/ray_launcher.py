"""Shards as Ray actors (`--distributed-executor-backend ray`): the ShardLauncher and ShardGroup
of core/backend_contract.py on a Ray cluster (`ray start --head`, KubeRay), or on a local Ray
instance when none runs.

The engine's process connects to the cluster as a driver (ParallelConfig.ray_address) and runs
rank 0 itself, as with processes. With `auto` (the default) it joins the cluster running on this
machine as `ray.init()` finds it (RAY_ADDRESS, else the one the last `ray start` recorded), and
when there is none it starts a local Ray instance of its own, as vLLM does: bound to 127.0.0.1,
sized by Ray to this machine, and ended with the engine's Ray connection. An explicit address
(HOST:PORT, ray://HOST:PORT) that does not answer is one line (RayClusterUnreachable), not
Ray's retries for minutes. The launcher reserves one bundle per worker shard in a
placement group (ParallelConfig.ray_placement_strategy), starts one actor per shard in its
bundle, and runs target(shard, *args) there. Each worker's ShardInfo is renumbered from where
Ray placed it: its local rank among the shards on its node (the engine counting as local rank 0
on its own node), and the rendezvous address is the engine's node address as Ray knows it.

A shard's end (its target raised, its actor was killed, its node was lost) is seen on the
actor's run() reference. Actors and the placement group belong to the engine's Ray job: stop()
kills them and removes the group, and if the engine process dies, however abruptly, Ray ends
its job's actors and groups with it. Ray is imported only when this launcher is used.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from ..backend_contract import ShardInfo
from ..config import RAY_PLACEMENT_STRATEGIES, ParallelConfig
from ..errors import BackendError

logger = logging.getLogger(__name__)

# How long the placement group may wait for the cluster's resources, and its actors to start,
# before the engine fails.
PLACEMENT_TIMEOUT_S = 120.0
# ParallelConfig.ray_address's default: the cluster on this machine, else a local instance.
# "local" (Ray's word) always starts a local instance.
AUTO_ADDRESS, LOCAL_ADDRESS = "auto", "local"
LOOPBACK = "127.0.0.1"  # where a local Ray instance's processes listen
# How long an explicit address may take to accept a connection before it is called unreachable.
CONNECT_TIMEOUT_S = 5.0
# What the engine's process is to Ray, whichever cluster it joins.
_DRIVER_OPTIONS = dict(include_dashboard=False, log_to_driver=True, namespace="switchyard")


class RayClusterUnreachable(BackendError):
    """The Ray cluster named cannot be reached (or its address read): one line, exit non-zero."""


@dataclass(frozen=True)
class ShardResources:
    """What one shard's bundle reserves, and the environment its actor starts with."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Ray narrows a GPU actor's visible devices to the ones it assigned; the shards instead see
    # their node's devices and drive the local_rank-th, as shard processes do (the engine, rank 0,
    # is not a Ray actor and drives local device 0 of its node).
    env: Mapping[str, str] = field(default_factory=dict)


# Per backend (Backend.name): what a shard of it reserves. A backend not listed cannot run its
# shards on Ray (PJRT and Neuron choose their devices in their own shard processes' environment).
SHARD_RESOURCES: dict[str, ShardResources] = {
    "cpu": ShardResources(num_cpus=1),
    "cuda": ShardResources(num_cpus=1, num_gpus=1, env={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}),
    "rocm": ShardResources(num_cpus=1, num_gpus=1, env={"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
                                                        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}),
    "xpu": ShardResources(num_cpus=1, num_gpus=1, env={"RAY_EXPERIMENTAL_NOSET_ONEAPI_DEVICE_SELECTOR": "1"}),
}


def resources_for(backend_name: str) -> ShardResources:
    try:
        return SHARD_RESOURCES[backend_name]
    except KeyError:
        raise ValueError(f"backend {backend_name!r} cannot run its shards on Ray "
                         f"(--distributed-executor-backend ray serves {', '.join(SHARD_RESOURCES)}); "
                         "use --distributed-executor-backend mp") from None


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'switchyard[ray]'") from None
    return ray


class _ShardActor:
    """One shard in a Ray worker process (made a Ray actor class by _actor_class)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, shard: ShardInfo, target: Callable[..., None], args: tuple) -> None:
        """target(shard, *args) with the standard rendezvous variables set; an exception
        reaches the launcher through this call's reference."""
        os.environ.update(RANK=str(shard.rank), LOCAL_RANK=str(shard.local_rank),
                          WORLD_SIZE=str(shard.world_size), LOCAL_WORLD_SIZE=str(shard.local_world_size),
                          MASTER_ADDR=shard.master_addr, MASTER_PORT=str(shard.master_port))
        from .distributed import destroy_process_group

        try:
            target(shard, *args)
        finally:
            destroy_process_group()


_ACTOR_CLASS = None


def _actor_class(ray):
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = ray.remote(_ShardActor)
    return _ACTOR_CLASS


@dataclass
class _Shard:
    rank: int
    actor: object  # ray.actor.ActorHandle
    done: object  # the ObjectRef of its run()


class RayShardGroup:
    """The actors one RayShardLauncher started and their placement group (the ShardGroup protocol)."""

    def __init__(self, ray, shards: list[_Shard], placement_group, names: tuple[str, ...],
                 node_ids: tuple[str, ...], disconnect: bool = False):
        self._ray = ray
        self._disconnect = disconnect
        self._shards = shards
        self._placement_group = placement_group
        self.actor_names = names  # named in the engine's namespace: `ray.get_actor` finds them
        self.node_ids = node_ids  # the Ray node of each shard, in the order started
        self._stopped = False

    @property
    def pids(self) -> tuple[int, ...]:
        """No local processes: the shards are Ray's worker processes, wherever Ray placed them."""
        return ()

    def _ended(self, shard: _Shard, ready: set | None = None) -> str | None:
        """None while its run() has not returned; "" when it returned; else how it ended."""
        if ready is None:
            ready = set(self._ray.wait([shard.done], timeout=0)[0])
        if shard.done not in ready:
            return None
        try:
            self._ray.get(shard.done)
        except self._ray.exceptions.RayTaskError as exc:  # target raised: its own exception
            cause = exc.cause if exc.cause is not None else exc
            return _first_line(f"{type(cause).__name__}: {cause}")
        except self._ray.exceptions.RayActorError as exc:
            return f"its Ray actor died ({_first_line(str(exc))})"
        except Exception as exc:  # noqa: BLE001 - a lost object or node: still this shard's end
            return _first_line(f"{type(exc).__name__}: {exc}")
        return ""

    def failure(self) -> str | None:
        """The first shard whose run() raised or whose actor died (one non-blocking ray.wait:
        the engine asks before every step); a shard whose target returned is not a failure."""
        refs = [s.done for s in self._shards]
        ready = set(self._ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for shard in self._shards:
            how = self._ended(shard, ready)
            if how:
                return f"Shard {shard.rank} terminated: {how}"
        return None

    def wait(self, timeout: float | None = None) -> bool:
        refs = [s.done for s in self._shards]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return len(ready) == len(refs)

    def stop(self, timeout: float = 10.0) -> None:
        """Kills every actor (Ray ends its worker process), removes the placement group, waits
        up to timeout for Ray to report the actors dead, and leaves the cluster when the
        launcher joined it."""
        if self._stopped:
            return
        self._stopped = True
        for shard in self._shards:
            self._ray.kill(shard.actor, no_restart=True)
        self._ray.util.remove_placement_group(self._placement_group)
        deadline = time.monotonic() + timeout
        for shard in self._shards:
            while time.monotonic() < deadline and self._ended(shard) is None:
                time.sleep(0.05)
        if self._disconnect:
            self._ray.shutdown()


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else "no message"


class RayShardLauncher:
    """One Ray actor per ShardInfo, in a placement group of one bundle per shard; returns once
    the group is placed and the actors have started (their target runs on)."""

    def __init__(self, parallel: ParallelConfig, resources: ShardResources):
        if parallel.nnodes != 1:
            raise ValueError("--distributed-executor-backend ray places the shards across the cluster's nodes "
                             f"itself: drop --nnodes {parallel.nnodes}")
        if parallel.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"Ray placement strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                             f"got {parallel.ray_placement_strategy!r}")
        self.parallel = parallel
        self.resources = resources
        self._ray = import_ray()
        self._connected_here = False  # this launcher joined the cluster, so its group leaves it

    def connect(self) -> None:
        """Joins Ray as a driver, once per process (an existing connection, e.g. a test's, is
        reused): the cluster at ParallelConfig.ray_address; with `auto`, the cluster running on
        this machine, else a local instance started here (`local`: always one)."""
        ray = self._ray
        if ray.is_initialized():
            return
        address = self.parallel.ray_address
        found = None
        if address == AUTO_ADDRESS:
            found = running_cluster()
        if address == LOCAL_ADDRESS or (address == AUTO_ADDRESS and found is None):
            self._connected_here = True
            start_local_instance(ray, "--ray-address local" if address == LOCAL_ADDRESS else
                                 "no Ray cluster is running on this machine (--ray-address auto)")
            return
        target = found or address
        check_reachable(target, address)
        self._connected_here = True
        ray.init(address=target, **_DRIVER_OPTIONS)
        logger.info("connected to the Ray cluster at %s", target)

    def _node_address(self, node_id: str) -> str:
        for node in self._ray.nodes():
            if node["NodeID"] == node_id:
                return node["NodeManagerAddress"]
        raise RuntimeError(f"Ray node {node_id} is not in the cluster")

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> RayShardGroup:
        ray = self._ray
        self.connect()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": self.resources.num_cpus}
        if self.resources.num_gpus:
            bundle["GPU"] = self.resources.num_gpus
        tag = f"switchyard-{uuid.uuid4().hex[:8]}"
        group = placement_group([dict(bundle) for _ in shards], strategy=self.parallel.ray_placement_strategy,
                                name=tag)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise RuntimeError(f"the Ray cluster did not place {len(shards)} shards of {bundle} "
                               f"({self.parallel.ray_placement_strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s; "
                               f"it has {ray.available_resources()}")
        actor_class = _actor_class(ray)
        env = dict(self.resources.env)
        actors, names = [], []
        try:
            for index, shard in enumerate(shards):
                name = f"{tag}-shard-{shard.rank}"
                options = dict(num_cpus=self.resources.num_cpus, num_gpus=self.resources.num_gpus, name=name,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=group, placement_group_bundle_index=index))
                if env:
                    options["runtime_env"] = {"env_vars": env}
                actors.append(actor_class.options(**options).remote())
                names.append(name)
            nodes = ray.get([a.node_id.remote() for a in actors], timeout=PLACEMENT_TIMEOUT_S)
            placed = _placed_shards(shards, nodes, ray.get_runtime_context().get_node_id(), self._node_address)
            started = [_Shard(s.rank, a, a.run.remote(s, target, tuple(args))) for s, a in zip(placed, actors)]
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)
            raise
        for shard, node in zip(placed, nodes):
            logger.info("shard %d on Ray node %s at %s (local rank %d of %d)", shard.rank, node[:8],
                        self._node_address(node), shard.local_rank, shard.local_world_size)
        return RayShardGroup(ray, started, group, tuple(names), tuple(nodes), disconnect=self._connected_here)


def running_cluster() -> str | None:
    """The cluster `ray.init()` would join on this machine (vLLM's default): RAY_ADDRESS, else
    the one the last `ray start` recorded; None when there is none. Ray's own lookup."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(None)
    except ConnectionError:  # RAY_ADDRESS=auto, and no cluster process on this machine
        return None


def start_local_instance(ray, why: str) -> None:
    """A Ray instance of this machine alone, started by this process and ended with its Ray
    connection (RayShardGroup.stop): every Ray process listening on 127.0.0.1, and Ray's own
    count of this machine's CPUs, GPUs and memory. Ray turns a loopback node address into the
    machine's routable one unless it is told that no cluster spans machines (its constant
    ENABLE_RAY_CLUSTER, which Ray reads once from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import):
    that constant is cleared for this call only, and no environment variable is set."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=LOCAL_ADDRESS, _node_ip_address=LOOPBACK, **_DRIVER_OPTIONS)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    resources = ray.cluster_resources()
    logger.info("%s: started a local Ray instance on %s with %g CPUs and %g GPUs", why, LOOPBACK,
                resources.get("CPU", 0), resources.get("GPU", 0))


def check_reachable(address: str, given: str) -> None:
    """RayClusterUnreachable, in one line, unless `address` (HOST:PORT or ray://HOST:PORT)
    accepts a TCP connection within CONNECT_TIMEOUT_S: Ray itself retries an address that does
    not answer for minutes. `given` is the address as configured (`auto` when it was found)."""
    where = address if given == address else f"{address} (found for --ray-address {given}: RAY_ADDRESS, else " \
        "the cluster the last `ray start` on this machine recorded)"
    rest = address.split("://", 1)[1] if "://" in address else address
    try:
        parts = urlsplit(f"//{rest}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise RayClusterUnreachable(f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT, auto or local")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RayClusterUnreachable(
            f"cannot reach the Ray cluster at {where}: {reason}; start it there (`ray start --head`), or leave "
            "--ray-address at auto to use this machine's cluster or a local Ray instance") from None


def _placed_shards(shards: Sequence[ShardInfo], node_ids: Sequence[str], engine_node: str,
                   node_address: Callable[[str], str]) -> list[ShardInfo]:
    """The workers' ShardInfos once placed: local ranks among the shards of each node (the
    engine, rank 0, is local rank 0 of its node) and the engine's node address as rendezvous."""
    per_node = Counter(node_ids)
    per_node[engine_node] += 1
    seen = Counter({engine_node: 1})
    master = node_address(engine_node)
    placed = []
    for shard, node in zip(shards, node_ids):
        placed.append(replace(shard, local_rank=seen[node], local_world_size=per_node[node], master_addr=master))
        seen[node] += 1
    return placed


def ray_shard_launcher(parallel: ParallelConfig, backend_name: str) -> RayShardLauncher:
    return RayShardLauncher(parallel, resources_for(backend_name))
