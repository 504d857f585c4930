"""Data-parallel replicas (`--data-parallel-size N`): N engines of one model behind one gateway.

`ReplicaSetClient` IS an `EngineClient` over N engine clients (each an engine process, each
possibly sharded), so the routes, /health and /metrics do not know there are several:

- **Placement**: on the CPU the server's cores are split into N disjoint, contiguous sets
  (`split_cpus`); each replica's `EngineConfig.parallel.cpus` carries its set, which its engine
  process takes as its affinity before the backend plans its threads (one thread per core of
  the set, bound; a sharded replica splits its set between its shards).
- **Routing** (`PrefixRouter`): every `add_requests` call (the n sequences of one prompt) goes
  to one replica. `cache-aware` (the default) hashes the prompt's full KV blocks as a chain, as
  the prefix cache does, and sends the prompt to the least loaded of the replicas that served
  its longest known prefix, unless that one is overloaded (more outstanding requests than
  `max(least + slack, ratio x least)`, SGLang's router's rule, with a slack that grows with the
  prefix's length: a miss costs its prefill), in which case the least-loaded replica takes it
  and holds the prefix too, so that a hot prefix spreads over the replicas it overloads and a
  cold one stays on one. `least-load` ignores prefixes; `round-robin` ignores load too.
- **Failure**: a replica whose engine dies fails its own streams (its client does that), leaves
  the rotation at once and is restarted by a supervisor thread; the others keep serving. The
  set is ready (/health 200) while at least one replica serves, and fails (the server exits
  non-zero) only when a replica cannot start: a start-up error (the configuration is the same
  for every replica), or `max_failed_starts` restarts in a row that did not come up.
- **Metrics**: each replica's step stats reach the gateway's metrics with the set's summed load,
  so TGI's gauges (`tgi_queue_size`, `tgi_batch_current_size`, `tgi_batch_max_total_tokens`...)
  are totals and its counters sums; `ReplicaMetrics` adds per-replica series labelled
  `replica="i"`.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from switchyard.core.engine.client_base import EngineClient, RequestStream
from switchyard.core.engine.process import ProcessEngineClient
from switchyard.core.engine.messages import EngineInfo, EngineLoad, StepStats
from switchyard.core.errors import EngineDeadError
from switchyard.core.params import ValidationError
from switchyard.core.scheduling.request import Request

from .metrics import Gauge

if TYPE_CHECKING:
    from switchyard.core.config import EngineConfig
    from switchyard.core.grammar.spec import GrammarSpec

logger = logging.getLogger("switchyard.replicas")

ROUTINGS = ("cache-aware", "least-load", "round-robin")


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """`cpus` in N contiguous, disjoint, nearly equal sets (the first ones one larger)."""
    cpus = sorted(cpus)
    if n > len(cpus):
        raise ValidationError(f"--data-parallel-size {n} needs at least {n} CPUs, this server may use {len(cpus)}")
    size, extra = divmod(len(cpus), n)
    sets, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        sets.append(tuple(cpus[start:end]))
        start = end
    return sets


def replica_configs(config: EngineConfig, n: int, cpus: Sequence[int] | None = None) -> list[EngineConfig]:
    """One EngineConfig per replica: the same model, each on its own share of `cpus` (default: the
    model's own, config.parallel.cpus, else every CPU this server may use)."""
    cpus = cpus if cpus is not None else config.parallel.cpus or os.sched_getaffinity(0)
    return [replace(config, parallel=replace(config.parallel, cpus=cpu_set)) for cpu_set in split_cpus(cpus, n)]


@dataclass(frozen=True)
class RoutingPolicy:
    """How `PrefixRouter` chooses (see the module docstring)."""

    routing: str = "cache-aware"
    block_size: int = 16  # the engine's KV block: a prefix is known in whole blocks
    max_blocks: int = 256  # a prompt's first blocks hashed (4,096 tokens at 16)
    # A prefix's holder takes its prompt while it has at most `load_slack` outstanding requests more
    # than the least loaded, or `load_ratio` times as many, whichever is more (sglang-router's
    # --balance-abs/rel-threshold); the slack grows with the prefix, by one request per
    # `tokens_per_request` of it, since a miss costs the prefix's prefill and a queued request
    # about as much as that many prompt tokens: a 1,000-token system prompt stays on its replica
    # under an imbalance of 15, a 16-token chat-template block spills at 4.
    load_slack: int = 4
    load_ratio: float = 2.0
    tokens_per_request: int = 64
    max_entries: int = 200_000  # prefix hashes remembered (least recently used dropped)

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValidationError(f"--data-parallel-routing must be one of {', '.join(ROUTINGS)}, "
                                  f"got {self.routing!r}")


def block_hashes(prompt: Sequence[int], block_size: int, max_blocks: int, salt: str | None = None) -> list[bytes]:
    """The chained hash of each of the prompt's first full blocks: entry k names tokens
    [0, (k+1) x block_size) (and the cache salt), as the engine's prefix cache keys them."""
    hashes: list[bytes] = []
    parent = hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
    for k in range(min(len(prompt) // block_size, max_blocks)):
        block = prompt[k * block_size:(k + 1) * block_size]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little", signed=True) for t in block),
                                 digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixRouter:
    """Chooses a replica per prompt; remembers which replica holds which prefix. Thread-safe."""

    def __init__(self, policy: RoutingPolicy):
        self.policy = policy
        # block hash -> the replicas that computed it (a dict as an ordered set), least recently used first
        self._holders: OrderedDict[bytes, dict[int, None]] = OrderedDict()
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.affinity_hits = 0  # prompts sent to a replica that held their prefix

    def choose(self, prompt: Sequence[int], loads: dict[int, int], salt: str | None = None) -> int:
        """The replica for `prompt` among `loads` (index -> outstanding requests; not empty)."""
        policy = self.policy
        candidates = sorted(loads)
        if policy.routing == "round-robin":
            return candidates[next(self._turn) % len(candidates)]
        least = min(candidates, key=lambda i: (loads[i], i))
        if policy.routing == "least-load":
            return least
        hashes = block_hashes(prompt, policy.block_size, policy.max_blocks, salt)
        with self._lock:
            depth = next((k for k in range(len(hashes), 0, -1) if hashes[k - 1] in self._holders), 0)
            holders = self._holders[hashes[depth - 1]] if depth else {}
            holder = min((i for i in holders if i in loads), key=lambda i: (loads[i], i), default=None)
            slack = max(policy.load_slack, depth * policy.block_size // policy.tokens_per_request)
            bound = max(loads[least] + slack, policy.load_ratio * loads[least])
            chosen = holder if holder is not None and loads[holder] <= bound else least
            self.affinity_hits += chosen == holder
            for h in hashes:
                self._holders.setdefault(h, {})[chosen] = None
                self._holders.move_to_end(h)
            while len(self._holders) > policy.max_entries:
                self._holders.popitem(last=False)
        return chosen

    def forget(self, index: int) -> None:
        """A replica restarted with an empty cache: it holds no prefix."""
        with self._lock:
            for h in list(self._holders):
                holders = self._holders[h]
                holders.pop(index, None)
                if not holders:
                    del self._holders[h]


class Replica:
    """One slot of the set: its current engine client and its history."""

    def __init__(self, index: int, client: ProcessEngineClient):
        self.index = index
        self.client = client
        self.restarts = 0
        self.failed_starts = 0  # in a row
        self.routed = 0  # add_requests calls sent here

    @property
    def serving(self) -> bool:
        return self.client.ready and self.client.failure is None


class ReplicaSetClient(EngineClient):
    """`make_replica(index)` builds (not starts) replica `index`'s engine client; it is called
    again to restart a dead one."""

    def __init__(self, make_replica: Callable[[int], ProcessEngineClient], size: int, policy: RoutingPolicy,
                 max_failed_starts: int = 3, restart_backoff_s: float = 1.0):
        self.on_step = None
        self._make = make_replica
        self.router = PrefixRouter(policy)
        self.replicas = [Replica(i, self._built(i)) for i in range(size)]
        self._max_failed_starts = max_failed_starts
        self._backoff_s = restart_backoff_s
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the replicas' clients

    def _built(self, index: int) -> ProcessEngineClient:
        client = self._make(index)
        client.on_step = lambda stats: self._observe(stats)
        return client

    # -- what the gateway reads ---------------------------------------------------------------
    def _serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving]

    @property
    def tokenizer(self):
        return next((r.client.tokenizer for r in self.replicas if r.client.tokenizer is not None), None)

    @property
    def info(self) -> EngineInfo | None:
        """One replica's (every replica runs the same configuration): its KV budget is per replica."""
        return next((r.client.info for r in self.replicas if r.client.info is not None), None)

    @property
    def ready(self) -> bool:
        return self._failure is None and any(r.serving for r in self.replicas)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def num_unfinished(self) -> int:
        return sum(r.client.num_unfinished for r in self.replicas)

    @property
    def load(self) -> EngineLoad | None:
        """The serving replicas' loads, summed."""
        loads = [r.client.load for r in self._serving() if r.client.load is not None]
        if not loads:
            return None
        return EngineLoad(num_running=sum(x.num_running for x in loads), num_waiting=sum(x.num_waiting for x in loads),
                          num_kv_blocks_used=sum(x.num_kv_blocks_used for x in loads),
                          num_kv_blocks_total=sum(x.num_kv_blocks_total for x in loads))

    # serve.py's start-up report (ProcessEngineClient's, through the first replica)
    @property
    def model_description(self) -> str | None:
        description = self.replicas[0].client.model_description
        return None if description is None else f"{description} x {len(self.replicas)} data-parallel replicas"

    @property
    def startup_error(self) -> BaseException | None:
        return self._failure if self.model_description is None else None

    def wait_model_checked(self, timeout: float | None = None) -> str:
        self.replicas[0].client.wait_model_checked(timeout)
        return self.model_description

    def export_metrics(self, metrics) -> None:
        """Adds the per-replica series to the gateway's Metrics."""
        series = ReplicaMetrics(self)
        metrics.register(series.metrics(), series.refresh)

    def _observe(self, stats: StepStats) -> None:
        if self.on_step is not None:
            self.on_step(replace(stats, load=self.load or stats.load))

    # -- requests -----------------------------------------------------------------------------
    async def add_requests(self, requests: list[Request]) -> list[RequestStream]:
        """All of them to one replica (the n sequences of a prompt share its blocks). A replica
        that died between the choice and the submit is left out and the next one tried."""
        if not requests:
            return []
        tried: set[int] = set()
        while True:
            serving = {r.index: r.client.num_unfinished for r in self._serving() if r.index not in tried}
            if not serving:
                raise EngineDeadError(f"no replica is serving: {self._failure}" if self._failure is not None
                                      else "no replica is serving")
            first = requests[0]
            index = self.router.choose(first.prompt_token_ids, serving, first.cache_salt)
            replica = self.replicas[index]
            replica.routed += 1
            try:
                return await replica.client.add_requests(requests)
            except EngineDeadError:
                if replica.client.failure is None:
                    raise
                tried.add(index)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:  # only the replica holding it sends an Abort
            replica.client.abort(request_id)

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Checked on one serving replica (the same one for the same spec, so its cache is
        reused); a replica that later takes the request without it compiles it on submit."""
        serving = self._serving()
        if not serving:
            raise EngineDeadError("no replica is serving")
        await serving[hash(spec) % len(serving)].client.compile_grammar(spec)

    async def load_lora(self, name: str, path: str) -> None:
        """On every replica, or on none: one that refuses undoes the loads of the others."""
        serving = self._serving()
        if not serving:
            raise EngineDeadError("no replica is serving")
        results = await asyncio.gather(*(r.client.load_lora(name, path) for r in serving), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(r.client.unload_lora(name) for r, result in zip(serving, results)
                                   if not isinstance(result, BaseException)), return_exceptions=True)
            raise errors[0]

    async def unload_lora(self, name: str) -> None:
        results = await asyncio.gather(*(r.client.unload_lora(name) for r in self._serving()),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._supervisor is not None:
            return
        for replica in self.replicas:
            replica.client.start()
        self._supervisor = threading.Thread(target=self._supervise, name="switchyard-replicas", daemon=True)
        self._supervisor.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until one replica serves; raises the set's failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            if self._failure is not None:
                raise self._failure
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no replica became ready in time")
            await asyncio.sleep(0.05)

    async def wait_all_ready(self, timeout: float | None = None) -> None:
        """Until every replica serves (tests, benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(r.serving for r in self.replicas):
            if self._failure is not None:
                raise self._failure
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("not every replica became ready in time")
            await asyncio.sleep(0.05)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            await asyncio.to_thread(self._supervisor.join, timeout)
        with self._lock:
            clients = [r.client for r in self.replicas]
        for result in await asyncio.gather(*(c.shutdown(timeout) for c in clients), return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("a replica did not shut down cleanly: %s", result)

    def _supervise(self) -> None:
        """Every 0.2 s: a replica that died (after serving, or while starting) is replaced."""
        while not self._stopping.wait(0.2):
            for replica in self.replicas:
                client = replica.client
                error = client.failure
                if error is None or self._stopping.is_set():
                    continue
                came_up = client.info is not None  # it served before it died
                replica.failed_starts = 0 if came_up else replica.failed_starts + 1
                if client.startup_error is not None and replica.restarts == 0:
                    self._fail(error)  # refused at the first start: every replica would be
                    return
                if replica.failed_starts >= self._max_failed_starts:
                    self._fail(EngineDeadError(f"replica {replica.index} did not restart "
                                               f"({replica.failed_starts} tries): {error}"))
                    return
                self._restart(replica, error)

    def _restart(self, replica: Replica, error: BaseException) -> None:
        logger.error("replica %d stopped serving (%s); restarting it", replica.index, error)
        self.router.forget(replica.index)
        old = replica.client
        _close_quietly(old)
        if replica.failed_starts:
            self._stopping.wait(self._backoff_s * replica.failed_starts)
        if self._stopping.is_set():
            return
        with self._lock:
            replica.client = self._built(replica.index)
            replica.restarts += 1
        replica.client.start()

    def _fail(self, error: BaseException) -> None:
        logger.error("the replicas cannot serve: %s", error)
        self._failure = error


def _close_quietly(client: EngineClient) -> None:
    """Stop what is left of a dead replica's client (its process has ended)."""
    try:
        asyncio.run(client.shutdown(timeout=2.0))
    except Exception:  # noqa: BLE001 - its pipe may be broken already: nothing left to stop
        logger.debug("closing a dead replica's client", exc_info=True)


class _Total(Gauge):
    """A counter whose value is a total kept elsewhere (set at each scrape)."""

    kind = "counter"


class ReplicaMetrics:
    """Per-replica series for /metrics, read live at each scrape (Metrics.register)."""

    def __init__(self, replicas: ReplicaSetClient):
        self._set = replicas
        lock = threading.Lock()
        self.up = Gauge("switchyard_replica_up", "1 while the replica serves", lock)
        self.restarts = _Total("switchyard_replica_restarts", "times the replica was restarted", lock)
        self.routed = _Total("switchyard_replica_routed_requests", "prompts routed to the replica", lock)
        self.running = Gauge("switchyard_replica_batch_current_size", "requests in the replica's running batch", lock)
        self.waiting = Gauge("switchyard_replica_queue_size", "requests waiting in the replica", lock)
        self.kv_usage = Gauge("switchyard_replica_kv_cache_usage_ratio", "fraction of the replica's KV blocks in use",
                              lock)
        self.affinity = _Total("switchyard_replica_affinity_routed", "prompts sent to the replica holding their "
                                "prefix (all replicas)", lock)

    def metrics(self) -> list:
        return [self.up, self.restarts, self.routed, self.running, self.waiting, self.kv_usage, self.affinity]

    def refresh(self) -> None:
        """Called at each scrape (before rendering)."""
        for replica in self._set.replicas:
            label = str(replica.index)
            self.up.set(1 if replica.serving else 0, replica=label)
            self.restarts.set(replica.restarts, replica=label)
            self.routed.set(replica.routed, replica=label)
            load = replica.client.load if replica.serving else None
            self.running.set(load.num_running if load else 0, replica=label)
            self.waiting.set(load.num_waiting if load else 0, replica=label)
            self.kv_usage.set(load.num_kv_blocks_used / max(1, load.num_kv_blocks_total) if load else 0,
                              replica=label)
        self.affinity.set(self._set.router.affinity_hits)


def add_replica_flags(parser, environ) -> None:
    """`switchyard serve`'s data-parallel flags (vLLM's --data-parallel-size)."""
    parser.add_argument("--data-parallel-size", type=int, default=int(environ.get("DATA_PARALLEL_SIZE") or 1),
                        help="engines (replicas) of the model behind this gateway, each on its own share of the "
                        "cores (each sharded by --num-shard) [env: DATA_PARALLEL_SIZE]")
    parser.add_argument("--data-parallel-routing", choices=ROUTINGS,
                        default=environ.get("DATA_PARALLEL_ROUTING") or "cache-aware",
                        help="how a prompt picks its replica: cache-aware (the replica holding its longest prefix "
                        "unless overloaded, else the least loaded), least-load, round-robin "
                        "[env: DATA_PARALLEL_ROUTING]")


def replica_set(config: EngineConfig, size: int, routing: str,
                make_engine: Callable[[EngineConfig], ProcessEngineClient]) -> ReplicaSetClient:
    """`size` replicas of `config`, each built by `make_engine` from its own EngineConfig."""
    if size < 1:
        raise ValidationError(f"--data-parallel-size must be at least 1, got {size}")
    if config.parallel.nnodes > 1:
        raise ValidationError("--data-parallel-size > 1 runs on one machine: it cannot be combined with --nnodes > 1")
    configs = replica_configs(config, size)
    for i, replica_config in enumerate(configs):
        logger.info("replica %d on CPUs %s", i, ",".join(map(str, replica_config.parallel.cpus)))
    return ReplicaSetClient(lambda i: make_engine(configs[i]), size,
                            RoutingPolicy(routing, block_size=config.cache.block_size))
