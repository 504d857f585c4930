"""`switchyard serve`'s LoRA flags: TGI's `--lora-adapters name=path,...` (env LORA_ADAPTERS),
vLLM's `--lora-modules name=path ...`, `--enable-lora` (adapters may also be loaded at run time),
`--max-loras`, `--max-lora-rank`, and `--lora-allowed-dir` (where run-time loads may read).
Adapters are local PEFT directories: nothing is downloaded."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from switchyard.core.config import LoraConfig
from switchyard.core.errors import ValidationError


def add_lora_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    defaults = LoraConfig()
    parser.add_argument("--lora-adapters", default=environ.get("LORA_ADAPTERS") or None,
                        help="LoRA adapters served from the start, comma-separated `name=path` (or a path, named by "
                        "its folder or .gguf file): local PEFT directories (adapter_config.json + "
                        "adapter_model.safetensors) or llama.cpp's LoRA .gguf files. "
                        "A request selects one by OpenAI `model` or TGI/gRPC `adapter_id` (default: none) [env: LORA_ADAPTERS]")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="vLLM's spelling of --lora-adapters (space-separated)")
    parser.add_argument("--enable-lora", action="store_true",
                        default=environ.get("ENABLE_LORA", "").lower() in ("1", "true", "yes", "on"),
                        help="serve LoRA adapters, loaded at run time too (POST /v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter; they take --api-key) [env: ENABLE_LORA]")
    parser.add_argument("--max-loras", type=int, default=defaults.max_loras,
                        help=f"adapters resident at once; one step uses at most this many (default {defaults.max_loras})")
    parser.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                        help=f"largest adapter rank served (default {defaults.max_lora_rank})")
    parser.add_argument("--lora-allowed-dir", action="append", default=[],
                        help="a directory run-time loads may read adapters under (repeatable; default: any local "
                        "directory)")


def parse_adapters(values: list[str]) -> tuple[tuple[str, str], ...]:
    """(name, absolute path) of each `name=path` or `path` (named by its last folder, or its .gguf
    file's name)."""
    pairs: list[tuple[str, str]] = []
    for value in values:
        name, sep, path = value.strip().partition("=")
        if not sep:
            path = value.strip()
            name = os.path.basename(path.rstrip("/")).removesuffix(".gguf")  # a folder's or a .gguf file's name
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValidationError(f"a LoRA adapter is `name=path` or a path; got {value!r}")
        if any(name == other for other, _ in pairs):
            raise ValidationError(f"two LoRA adapters are named {name!r}")
        pairs.append((name, os.path.abspath(os.path.expanduser(path))))
    return tuple(pairs)


def lora_config(args: argparse.Namespace) -> LoraConfig:
    """The engine's LoraConfig of these flags."""
    values = [v for v in (args.lora_adapters or "").split(",") if v.strip()] + list(args.lora_modules)
    adapters = parse_adapters(values)
    if args.max_loras < 1:
        raise ValidationError(f"--max-loras must be at least 1, got {args.max_loras}")
    if args.max_lora_rank < 1:
        raise ValidationError(f"--max-lora-rank must be at least 1, got {args.max_lora_rank}")
    return LoraConfig(adapters=adapters, enable=args.enable_lora, max_loras=args.max_loras,
                      max_lora_rank=args.max_lora_rank)


def allowed_dirs(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(os.path.realpath(os.path.expanduser(d)) for d in args.lora_allowed_dir)
