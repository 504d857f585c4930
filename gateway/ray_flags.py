"""`switchyard serve`'s Ray flags (core/shards/ray_launcher.py): `--distributed-executor-backend
{mp,ray}` (vLLM's flag), the cluster's `--ray-address` and the shards' `--ray-placement-strategy`.
Checked here, before anything loads, into ParallelConfig's fields; Ray is not imported."""
from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping

from switchyard.core.config import EXECUTOR_BACKENDS, RAY_PLACEMENT_STRATEGIES


def add_ray_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                        default=environ.get("DISTRIBUTED_EXECUTOR_BACKEND") or "mp",
                        help="who starts shards 1..N-1 of --num-shard N: mp, local processes (one serve per node "
                        "with --nnodes); ray, Ray actors in a placement group on a Ray cluster, or on a local Ray "
                        "instance when none runs (needs switchyard[ray]) [env: DISTRIBUTED_EXECUTOR_BACKEND]")
    parser.add_argument("--ray-address", default=environ.get("RAY_ADDRESS") or "auto",
                        help="the Ray cluster to place shards on: HOST:PORT or ray://HOST:PORT (one that does not "
                        "answer is an error); auto, the cluster `ray start` started on this machine, else a local "
                        "Ray instance on 127.0.0.1 that the engine starts (and logs); local, always that "
                        "(default: auto) [env: RAY_ADDRESS]")
    parser.add_argument("--ray-placement-strategy", choices=RAY_PLACEMENT_STRATEGIES, default="PACK",
                        help="how the shards' bundles spread over the Ray nodes (PACK: as few nodes as fit; "
                        "STRICT_SPREAD: one node each)")


def ray_parallel_options(args: argparse.Namespace) -> dict:
    """ParallelConfig's executor fields, or ValidationError (a one-line user error)."""
    from switchyard.core.params import ValidationError

    if args.distributed_executor_backend == "ray":
        if args.nnodes != 1:
            raise ValidationError(f"--distributed-executor-backend ray places the shards on the cluster's nodes "
                                  f"itself: drop --nnodes {args.nnodes} (one serve, on any node of the cluster)")
        if importlib.util.find_spec("ray") is None:
            raise ValidationError("--distributed-executor-backend ray needs Ray: pip install 'switchyard[ray]'")
    return dict(executor_backend=args.distributed_executor_backend, ray_address=args.ray_address,
                ray_placement_strategy=args.ray_placement_strategy)
