"""Shards as Ray actors (`--distributed-executor-backend ray`): the ShardLauncher and ShardGroup
of core/backend_contract.py on an existing Ray cluster (`ray start --head`, KubeRay).

The engine's process connects to the cluster as a driver (ParallelConfig.ray_address) and runs
rank 0 itself, as with processes. The launcher reserves one bundle per worker shard in a
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
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .backend_contract import ShardInfo
from .config import RAY_PLACEMENT_STRATEGIES, ParallelConfig

logger = logging.getLogger(__name__)

# How long the placement group may wait for the cluster's resources, and its actors to start,
# before the engine fails.
PLACEMENT_TIMEOUT_S = 120.0


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
        """Joins the cluster at ParallelConfig.ray_address as a driver (once per process; an
        existing connection, e.g. a test's, is reused)."""
        ray = self._ray
        if not ray.is_initialized():
            self._connected_here = True
            ray.init(address=self.parallel.ray_address, include_dashboard=False, log_to_driver=True,
                     namespace="switchyard")
            logger.info("connected to the Ray cluster at %s", self.parallel.ray_address)

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
