"""Which adapters the engine serves, which are resident in the stacks' slots, and for which requests.

Known adapters are held in host memory, by name (`load`, `unload`). Before each step the runner
asks for the step's adapters (`activate`): each gets a slot, copied in when it is not resident,
in place of the least recently used adapter that the step does not use (the scheduler puts at
most max_loras adapters in one step, core/scheduling/adapters.py). An unloaded adapter serves no
new request; the requests that use it finish with it, and it is dropped once none is left
(`release_unused`). A request names its adapter by name; its prefix-cache salt names the load
(`admit`), so two adapters, or two loads under one name, never share cached blocks.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch

from ..config import LoraConfig
from .adapter import LoraAdapter, LoraAdapterError
from .sources import load_adapter
from .context import LoraContext
from .stacks import LoraStack
from .targets import LoraTarget, TargetKind

logger = logging.getLogger(__name__)

GB = 10**9


class LoraManager:
    def __init__(self, config: LoraConfig, targets: dict[tuple[str, int], LoraTarget],
                 stacks: dict[tuple[str, int], LoraStack], context: LoraContext, dtype: torch.dtype,
                 adapters: Iterable[LoraAdapter] = ()):
        """`adapters`: those named at start, already read (their uids 1, 2, ...)."""
        self.config = config
        self.targets = targets
        self.stacks = stacks
        self.context = context
        self.dtype = dtype
        self.adapters: dict[str, LoraAdapter] = {a.name: a for a in adapters}  # served to new requests
        self.retiring: dict[str, LoraAdapter] = {}  # unloaded; requests in flight still use them
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._free_slots = list(range(config.max_loras))
        self._uids = itertools.count(1 + max((a.uid for a in self.adapters.values()), default=0))

    # -- what is served ---------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, read and checked (LoraAdapterError), not yet served."""
        if not name or not isinstance(name, str):
            raise LoraAdapterError(f"a LoRA adapter needs a name, got {name!r}")
        self._check_name_free(name)
        adapter = load_adapter(name, path, self.targets, self.config.max_lora_rank, self.dtype, next(self._uids))
        missing = sorted({self.targets[key].kind.value for key in adapter.weights if key not in self.stacks})
        if missing:
            raise LoraAdapterError(f"LoRA adapter {name!r} targets the {' and '.join(missing)} layer, which only "
                                   "adapters named at start (--lora-adapters) may target")
        return adapter

    def load(self, name: str, path: str) -> LoraAdapter:
        """Serve the adapter at `path` as `name`; checked fully before anything changes."""
        return self.serve(self.read(name, path))

    def _check_name_free(self, name: str) -> None:
        """A load may take `name` (LoraAdapterError if an adapter served or being unloaded has it)."""
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded")
        if name in self.retiring:
            raise LoraAdapterError(f"LoRA adapter {name!r} is being unloaded: requests still use it")

    def serve(self, adapter: LoraAdapter) -> LoraAdapter:
        """Serve an adapter `read` gave (perhaps on another thread, while steps ran): its name is
        checked again, since another load or an unload may have come between."""
        name = adapter.name
        self._check_name_free(name)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s: rank %d, %d layers, %.1f MB", name, adapter.path,
                    adapter.rank, len(adapter.weights), adapter.nbytes / 1e6)
        return adapter

    def unload(self, name: str, in_use: bool) -> None:
        """Serve `name` to no new request; `in_use`: requests in flight still use it (it stays
        until they finish, release_unused)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded"
                                   + (" (it is being unloaded)" if name in self.retiring else ""))
        if in_use:
            self.retiring[name] = adapter
        else:
            self._evict(name)
        logger.info("LoRA adapter %r unloaded%s", name, " (its requests in flight finish with it)" if in_use else "")

    def release_unused(self, in_use: Iterable[str]) -> None:
        """Drops the unloaded adapters no request uses any more."""
        used = set(in_use)
        for name in [n for n in self.retiring if n not in used]:
            del self.retiring[name]
            self._evict(name)

    def admit(self, request) -> None:
        """Checks that a request's adapter is served (LoraAdapterError) and keys its prefix-cache
        salt by this load of it: the one place the adapter becomes part of the salt."""
        name = request.lora_name
        if name is None:
            return
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            state = "was unloaded" if name in self.retiring else "is unknown"
            raise LoraAdapterError(f"LoRA adapter {name!r} {state} (served: {served})", "model")
        request.cache_salt = f"{request.cache_salt or ''}\x00lora\x00{adapter.uid}"

    # -- slots ------------------------------------------------------------------------------
    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """The slot of each adapter of a step, making resident those that are not (evicting the
        least recently used adapters the step does not use)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than --max-loras "
                               f"{self.config.max_loras}")
        slots = {}
        for name in wanted:
            if name in self._resident:
                self._resident.move_to_end(name)
            else:
                self._make_resident(name, wanted)
            slots[name] = self._resident[name]
        return slots

    @property
    def resident(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        return tuple(self._resident)

    def _make_resident(self, name: str, step: list[str]) -> None:
        adapter = self.adapters.get(name) or self.retiring.get(name)
        if adapter is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        if not self._free_slots:
            victim = next(n for n in self._resident if n not in step)
            self._evict(victim)
        slot = self._free_slots.pop(0)
        for key, stack in self.stacks.items():
            stack.write(slot, adapter.weights.get(key))
        self._resident[name] = slot

    def _evict(self, name: str) -> None:
        slot = self._resident.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._free_slots.sort()

    # -- what it costs ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(stack.nbytes for stack in self.stacks.values())

    def describe(self) -> str:
        kinds = sorted({stack.target.kind.value for stack in self.stacks.values()})
        return (f"LoRA: {self.config.max_loras} slots of rank {self.config.max_lora_rank} over "
                f"{len(self.stacks)} targets ({', '.join(kinds)}), {self.nbytes / GB:.2f} GB; "
                f"adapters: {', '.join(self.names) or 'none yet'}")


def stack_targets(targets: dict[tuple[str, int], LoraTarget], adapters: Iterable[LoraAdapter]
                  ) -> dict[tuple[str, int], LoraTarget]:
    """The targets that get stacks: every decoder projection (an adapter loaded later may target
    any), and the embedding and head where an adapter named at start targets them."""
    kinds = {TargetKind.LINEAR}.union(*(a.kinds for a in adapters))
    return {key: t for key, t in targets.items() if t.kind in kinds}
