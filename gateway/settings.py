"""Server settings from the CLI (TGI's launcher flags), frozen; and the limits
resolved against the loaded model."""
from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.core.config import TracingConfig

from .lora.adapters import LoraSettings
from .media.policy import MediaPolicy


@dataclass(frozen=True)
class ServerSettings:
    model_id: str  # the name served in /info and /v1/models
    hostname: str = "127.0.0.1"
    port: int = 8080
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: the model's context length
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    api_key: str | None = None
    cors_allow_origin: tuple[str, ...] = ()
    payload_limit: int = 2_000_000  # bytes
    json_output: bool = False
    disable_grammar_support: bool = False
    graceful_shutdown_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    served_model_names: tuple[str, ...] = ()  # extra names accepted as `model`
    grpc_port: int | None = None  # TGIS's gRPC API (gateway/grpc) on this port; None: off
    tracing: TracingConfig = field(default_factory=TracingConfig)  # --otlp-endpoint (gateway/tracing.py)
    reasoning_parser: str = "auto"  # --reasoning-parser (gateway/reasoning/select.py)
    tool_call_parser: str = "auto"  # --tool-call-parser (gateway/tool_parsers/select.py)
    lora: LoraSettings = field(default_factory=LoraSettings)  # adapters (gateway/lora)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # images accepted (gateway/media)
    version: str = "0.1.0"


@dataclass(frozen=True)
class Limits:
    """Per-request token limits, known once the engine is up."""

    max_input_tokens: int
    max_total_tokens: int

    @classmethod
    def resolve(cls, settings: ServerSettings, max_model_len: int) -> Limits:
        total = min(settings.max_total_tokens or max_model_len, max_model_len)
        max_input = settings.max_input_tokens if settings.max_input_tokens is not None else total - 1
        if not 0 < max_input < total:
            raise ValueError(f"--max-input-tokens ({max_input}) must be positive and below "
                             f"--max-total-tokens ({total})")
        return cls(max_input_tokens=max_input, max_total_tokens=total)
