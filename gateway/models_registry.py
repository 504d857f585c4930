"""Several models behind one gateway: `--model-id A --model-id B`, or `--models FILE`.

`ModelRegistry` maps a served name to a `ModelEntry`: its EngineConfig, its replicas, and, once
loaded, its own engine client (a ReplicaSetClient with replicas > 1) and GenerationService, so
each model has its own engine process, KV budget, tokenizer and limits, and one model's load
never stalls another's streams (they share the cores, not a step loop).

- The first model is the default: loaded at start (the server's /health follows it), answering
  the TGI routes and the OpenAI placeholder names ("tgi", "default", ...). The others load on
  their first request.
- A request for a model still loading waits up to `load_wait_s`, then gets 503 with Retry-After.
- At most `max_loaded` models are loaded: to load another, the least recently used model that
  has no request in flight and has been idle `idle_timeout_s` is unloaded (its engine stopped);
  if none may be, the request gets 503 with Retry-After. A model whose engine died is loaded
  again by its next request (the default model's death stops the server, as with one model).
- `service_for(http_request, name)` is what routes call: with one model (no registry) it is
  `app.state.service`, with no extra hop.

The models file (YAML) is a list, or a mapping with a `models` list, of entries:
`name` (required), `source` (a --model-id value; default: the name), `dtype`, `quantize`,
`replicas` (--data-parallel-size), `shards` (--num-shard), `max_batch_total_tokens`, `priority`,
`cpus`; anything not given is the command line's. `priority: background` keeps a model's engine
at idle CPU priority once loaded, not only while it loads: it computes only when the cores are
otherwise free, so the models beside it keep their inter-token latency while it answers, at the
cost of its own speed whenever they stream (core/engine/priority.py); `normal` (the default)
shares the cores evenly once loaded. `cpus` ("0-3,6" as taskset writes it, or a list) gives a
model's engine (its replicas split them) only those logical CPUs: models on disjoint cores
disturb each other least, each at the speed of its own cores.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from switchyard.core.config import LoraConfig
from switchyard.core.params import ValidationError

from .errors import ErrorKind, GatewayError
from .lora.adapters import LoraSettings
from .settings import ServerSettings

if TYPE_CHECKING:  # imported where used: `switchyard serve --help` reads only the flags here
    from switchyard.core.engine.client_base import EngineClient
    from switchyard.core.config import EngineConfig

    from .metrics import Metrics
    from .service import GenerationService

logger = logging.getLogger("switchyard.models")

# `model` values that mean "the default model" (gateway/openai/common.py's placeholders)
_DEFAULT_NAMES = ("", "default", "tgi", "dummy")
MODEL_HEADER = "x-model"  # TGI routes: the model named in this header, or in ?model=
_FILE_KEYS = {"name", "source", "mmproj", "dtype", "quantize", "replicas", "shards", "max_batch_total_tokens",
              "priority", "cpus", "task", "pooling"}
PRIORITIES = ("normal", "background")


@dataclass(frozen=True)
class ModelSpec:
    """One served model, as configured."""

    name: str
    config: EngineConfig
    replicas: int = 1


class ModelEntry:
    """A model's state: loaded (client and service) or not."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.client: EngineClient | None = None
        self.service: GenerationService | None = None
        self.last_used = time.monotonic()
        self.loaded_at: float | None = None

    @property
    def loaded(self) -> bool:
        return self.client is not None

    @property
    def busy(self) -> bool:
        return self.client is not None and self.client.num_unfinished > 0


class ModelRegistry:
    """`make_client(spec)` builds (not starts) a model's engine client."""

    def __init__(self, specs: list[ModelSpec], make_client: Callable[[ModelSpec], EngineClient],
                 settings: ServerSettings, metrics: Metrics, max_loaded: int | None = None,
                 idle_timeout_s: float = 300.0, load_wait_s: float = 60.0):
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValidationError(f"two models have the same name: {', '.join(names)}")
        if max_loaded is not None and max_loaded < 1:
            raise ValidationError(f"--max-loaded-models must be at least 1, got {max_loaded}")
        self.entries = {spec.name: ModelEntry(spec) for spec in specs}
        self.default = specs[0].name
        self._make = make_client
        self._settings = settings
        self._metrics = metrics
        self.max_loaded = max_loaded or len(specs)
        self.idle_timeout_s = idle_timeout_s
        self.load_wait_s = load_wait_s
        self._lock = asyncio.Lock()  # one load or unload decision at a time

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def adopt_default(self, client: EngineClient, service: GenerationService) -> None:
        """The default model's client and service, started with the app (create_app)."""
        entry = self.entries[self.default]
        entry.client, entry.service, entry.loaded_at = client, service, time.monotonic()

    def entry(self, name: str | None) -> ModelEntry:
        """The entry of a request's `model`; OpenAI's 404 model_not_found for one not served."""
        if name is None or name in _DEFAULT_NAMES:
            return self.entries[self.default]
        if name not in self.entries:
            raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"The model `{name}` does not exist. Served: "
                               f"{', '.join(self.entries)}", "model")
        return self.entries[name]

    async def service(self, name: str | None) -> GenerationService:
        """The model's service once it serves: loads it (unloading an idle one) and waits for it."""
        entry = self.entry(name)
        entry.last_used = time.monotonic()
        if entry.client is None or (entry.client.failure is not None and entry.spec.name != self.default):
            async with self._lock:
                if entry.client is None or entry.client.failure is not None:
                    await self._load(entry)
        client = entry.client
        if not client.ready and client.failure is None:
            try:
                await asyncio.wait_for(client.wait_ready(), self.load_wait_s)
            except asyncio.TimeoutError:
                raise GatewayError(ErrorKind.UNAVAILABLE, f"the model `{entry.spec.name}` is loading; "
                                   "retry shortly") from None
            except Exception:  # noqa: BLE001 - the service reports the engine's failure (503) itself
                pass
        entry.last_used = time.monotonic()
        return entry.service

    async def _load(self, entry: ModelEntry) -> None:
        if entry.client is not None:  # it died: what is left of it goes first
            await self._unload(entry, "its engine stopped")
        loaded = [e for e in self.entries.values() if e.loaded]
        if len(loaded) >= self.max_loaded:
            now = time.monotonic()
            idle = [e for e in loaded if e.spec.name != self.default and not e.busy
                    and now - e.last_used >= self.idle_timeout_s]
            if not idle:
                raise GatewayError(ErrorKind.UNAVAILABLE, f"cannot load `{entry.spec.name}`: "
                                   f"{len(loaded)} models are loaded (--max-loaded-models) and none has been idle "
                                   f"{self.idle_timeout_s:g} s (--model-idle-timeout)")
            await self._unload(min(idle, key=lambda e: e.last_used), f"to load {entry.spec.name}")
        from .service import GenerationService

        logger.info("loading model %s", entry.spec.name)
        # loaded at idle CPU priority, so the models serving beside it keep their pace (core/engine/priority.py)
        client = self._make(replace(entry.spec, config=replace(entry.spec.config, start_in_background=True)))
        lora = self._settings.lora if entry.spec.name == self.default else LoraSettings()  # the default's flags
        service = GenerationService(client, replace(self._settings, model_id=entry.spec.name,
                                                    served_model_names=(), lora=lora), self._metrics)
        client.on_step = lambda stats: self._metrics.observe_step(stats, client.info.block_size)
        client.start()
        entry.client, entry.service, entry.loaded_at = client, service, time.monotonic()

    async def _unload(self, entry: ModelEntry, why: str) -> None:
        logger.info("unloading model %s (%s)", entry.spec.name, why)
        client, entry.client, entry.service = entry.client, None, None
        await client.shutdown()

    async def shutdown(self) -> None:
        """Stops every model loaded on demand (the default one stops with the app)."""
        await asyncio.gather(*(self._unload(e, "shutting down") for e in self.entries.values()
                               if e.loaded and e.spec.name != self.default), return_exceptions=True)

    def adapter_owner(self, name: str | None) -> str | None:
        """The loaded model that serves a LoRA adapter named `name` (gateway/lora), if one does."""
        for entry_name, entry in self.entries.items():
            if entry.service is not None and name in entry.service.adapters:
                return entry_name
        return None

    def cards(self) -> list[tuple[str, ModelEntry]]:
        return list(self.entries.items())


async def service_for(http_request, name: str | None) -> GenerationService:
    """The service of the model a request names (OpenAI: its `model`; TGI: the X-Model header or
    ?model=, else the default model)."""
    registry: ModelRegistry | None = http_request.app.state.models
    if registry is None:
        service = http_request.app.state.service
        return service.with_adapter(name, "model") if name in service.adapters else service
    owner = registry.adapter_owner(name)
    if owner is not None:
        return (await registry.service(owner)).with_adapter(name, "model")
    return await registry.service(name)


def tgi_model_name(http_request) -> str | None:
    """The model a TGI route asks for: the `X-Model` header, else the `model` query parameter."""
    return http_request.headers.get(MODEL_HEADER) or http_request.query_params.get("model")


# -- configuration ------------------------------------------------------------------------------
class ModelIds(argparse.Action):
    """`--model-id` given again adds a model: the first is args.model (as before), the others
    args.extra_models."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "_model_given", False):
            namespace.extra_models = [*getattr(namespace, "extra_models", []), values]
        else:
            namespace.model = values
            namespace._model_given = True


def add_model_flags(parser: argparse.ArgumentParser, environ) -> None:
    parser.set_defaults(extra_models=[])
    parser.add_argument("--models", default=environ.get("MODELS_FILE") or None,
                        help="a YAML file listing the models to serve (name, source, mmproj, dtype, quantize, replicas, "
                        "shards, max_batch_total_tokens, priority: normal|background, cpus: \"0-3\"); the first "
                        "is the default [env: MODELS_FILE]")
    parser.add_argument("--max-loaded-models", type=int, default=None,
                        help="most models loaded at once; another unloads the least recently used idle one "
                        "(default: all)")
    parser.add_argument("--model-idle-timeout", type=float, default=300.0,
                        help="seconds without requests after which a model may be unloaded for another")
    parser.add_argument("--model-load-timeout", type=float, default=60.0,
                        help="seconds a request waits for its model to load before a 503 with Retry-After")


def model_specs(args: argparse.Namespace, config: EngineConfig, default_name: str) -> list[ModelSpec]:
    """The models to serve: the command line's --model-id values, or the --models file."""
    if args.models is not None:
        if args.extra_models:
            raise ValidationError("give the models either with --model-id (repeated) or with --models, not both")
        if config.model.mmproj is not None:
            raise ValidationError("with --models, give a vision model's mmproj file as its entry's `mmproj` key, "
                                  "not --mmproj")
        return _file_specs(args.models, config, args.data_parallel_size)
    specs = [ModelSpec(default_name, config, args.data_parallel_size)]
    for source in args.extra_models:  # the LoRA flags name adapters of the default model only
        specs.append(ModelSpec(source.rstrip("/"), replace(config, model=replace(config.model, model=source, mmproj=None),
                                                           lora=LoraConfig()), args.data_parallel_size))
    return specs


def _file_specs(path: str, config: EngineConfig, replicas: int) -> list[ModelSpec]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError(f"--models {path}: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValidationError(f"--models {path}: expected a list of models (name, source, ...)")
    specs = []
    for i, item in enumerate(entries):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValidationError(f"--models {path}: entry {i} needs a `name`")
        unknown = set(item) - _FILE_KEYS
        if unknown:
            raise ValidationError(f"--models {path}: model {item['name']!r} has unknown keys "
                                  f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(_FILE_KEYS))})")
        mmproj = item.get("mmproj")  # llama.cpp's vision tower file beside a GGUF source (--mmproj's)
        if mmproj is not None and not isinstance(mmproj, str):
            raise ValidationError(f"--models {path}: model {item['name']!r} has mmproj {mmproj!r} (a file path)")
        model = replace(config.model, model=item.get("source", item["name"]), mmproj=mmproj,
                        dtype=item.get("dtype", config.model.dtype),
                        quantize=item.get("quantize", config.model.quantize), **_task_keys(item, config, path))
        shards = int(item.get("shards", config.parallel.tensor_parallel_size))
        parallel = replace(config.parallel, tensor_parallel_size=shards)
        if "cpus" in item:
            parallel = replace(parallel, cpus=parse_cpus(item["cpus"], f"--models {path}: model {item['name']!r}"))
        cache = config.cache
        if "max_batch_total_tokens" in item:
            cache = replace(cache, num_blocks=int(item["max_batch_total_tokens"]) // cache.block_size + 1)
        priority = item.get("priority", "normal")
        if priority not in PRIORITIES:
            raise ValidationError(f"--models {path}: model {item['name']!r} has priority {priority!r} "
                                  f"(one of: {', '.join(PRIORITIES)})")
        specs.append(ModelSpec(item["name"], replace(config, model=model, parallel=parallel, cache=cache,
                                                     serve_in_background=priority == "background",
                                                     lora=config.lora if i == 0 else LoraConfig()),
                               int(item.get("replicas", replicas))))
    return specs


def _task_keys(item: dict, config: EngineConfig, path: str) -> dict:
    """A models file entry's `task` (generate, embed, auto) and `pooling` (last, mean, cls): how that
    model is served (core/pooling/decide.py), over --task and --pooling."""
    from switchyard.core.pooling.spec import POOLING_METHODS, TASKS

    task, pooling = item.get("task", config.model.task), item.get("pooling", config.model.pooling)
    if task not in TASKS or (pooling is not None and pooling not in POOLING_METHODS):
        raise ValidationError(f"--models {path}: model {item['name']!r} has task {task!r} / pooling {pooling!r} "
                              f"(task: one of {', '.join(TASKS)}; pooling: one of {', '.join(POOLING_METHODS)})")
    return {"task": task, "pooling": pooling}


def parse_cpus(value, where: str) -> tuple[int, ...]:
    """A CPU list as taskset and cgroups write it ("0-3,6") or a list of ints: sorted logical
    CPUs, each one this server may run on."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            cpus = {value}
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            cpus = set(value)
        elif isinstance(value, str):
            cpus = set()
            for part in value.replace(" ", "").split(","):
                low, _, high = part.partition("-")
                cpus.update(range(int(low), int(high or low) + 1))
        else:
            raise ValueError
    except ValueError:
        raise ValidationError(f"{where}: cpus {value!r} is not a CPU list (\"0-3,6\" or [0, 1])") from None
    if not hasattr(os, "sched_getaffinity"):
        raise ValidationError(f"{where}: cpus needs an OS with CPU affinity (Linux)")
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValidationError(f"{where}: cpus {value!r} must be among the CPUs this server may use "
                              f"({','.join(map(str, sorted(allowed)))})")
    return tuple(sorted(cpus))


def install_models(app, specs: list[ModelSpec], args: argparse.Namespace,
                   make_client: Callable[[ModelSpec], EngineClient]) -> ModelRegistry | None:
    """With several models, the registry the routes dispatch through (app.state.models), the
    default model's client and service adopted from the app; None with one model."""
    if len(specs) == 1:
        return None
    registry = ModelRegistry(specs, make_client, app.state.settings, app.state.metrics, args.max_loaded_models,
                             args.model_idle_timeout, args.model_load_timeout)
    registry.adopt_default(app.state.service.client, app.state.service)
    app.state.models = registry
    logger.info("serving %d models: %s (default %s)", len(specs), ", ".join(registry.names), registry.default)
    return registry
