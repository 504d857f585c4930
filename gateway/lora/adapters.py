"""One engine's LoRA adapters as the gateway routes to them: name -> path.

A request names an adapter where it names a model (OpenAI `model`) or in `adapter_id` (TGI,
gRPC); `GenerationService.with_adapter` then stamps its engine requests with that name. The
run-time routes change the set through the engine (core/lora validates the files and answers
first); this object only records what the engine accepted, and decides which paths a run-time
load may read (`--lora-allowed-dir`)."""
from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass

from switchyard.core.errors import ValidationError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")


class AdapterNotFound(LookupError):
    """No adapter of that name is served (a 404 where the dialect has one)."""


@dataclass(frozen=True)
class LoraSettings:
    """What the CLI says of adapters (gateway/lora/flags.py): whether they are served, those
    served from the start as (name, path), and the directories run-time loads may read (none: any)."""

    enabled: bool = False
    adapters: tuple[tuple[str, str], ...] = ()
    allowed_dirs: tuple[str, ...] = ()


class LoraAdapters:
    def __init__(self, settings: LoraSettings, reserved: tuple[str, ...] = ()):
        """reserved: names an adapter may not take (the model's own served names)."""
        self.settings = settings
        self._reserved = set(reserved)
        self._paths: dict[str, str] = dict(settings.adapters)
        self._lock = asyncio.Lock()  # one load or unload at a time

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._paths

    def items(self) -> list[tuple[str, str]]:
        return list(self._paths.items())

    def check_path(self, path: str) -> str:
        """The real path a run-time load reads, or a ValidationError: a local directory (or .gguf
        file) given as an absolute path, under one of --lora-allowed-dir when any is given."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValidationError("`lora_path` must be a local directory", "lora_path")
        if "://" in path:
            raise ValidationError(f"`lora_path` must be a local directory, not a URL ({path!r}): adapters are "
                                  "not downloaded", "lora_path")
        if not os.path.isabs(path):
            raise ValidationError(f"`lora_path` must be an absolute path, got {path!r}", "lora_path")
        real = os.path.realpath(path)
        allowed = self.settings.allowed_dirs
        if allowed and not any(os.path.commonpath([real, root]) == root for root in allowed):
            raise ValidationError(f"`lora_path` {path!r} is outside the directories adapters may be loaded from "
                                  "(--lora-allowed-dir)", "lora_path")
        if not os.path.isdir(real) and not (os.path.isfile(real) and real.lower().endswith(".gguf")):
            raise ValidationError(f"`lora_path` {path!r} is not a directory (a PEFT adapter) or a .gguf file "
                                  "(llama.cpp's LoRA adapter)", "lora_path")
        return real

    async def load(self, client, name: str, path: str) -> None:
        """Load through the engine, which checks the adapter against the base model first."""
        self._require_enabled()
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError(f"`lora_name` must be 1-128 letters, digits or ._:/@- (starting with a letter or "
                                  f"digit), got {name!r}", "lora_name")
        if name in self._reserved:
            raise ValidationError(f"`lora_name` {name!r} is the model's own name", "lora_name")
        real = self.check_path(path)
        async with self._lock:
            if name in self._paths:
                raise ValidationError(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")
            await client.load_lora(name, real)
            self._paths[name] = real

    async def unload(self, client, name: str) -> None:
        self._require_enabled()
        async with self._lock:
            if name not in self._paths:
                raise AdapterNotFound(f"no LoRA adapter named {name!r} is loaded")
            await client.unload_lora(name)
            del self._paths[name]

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise ValidationError("LoRA adapters are not served: start the server with --enable-lora or "
                                  "--lora-adapters")
