"""FastAPI app factory: the engine client's life cycle, cross-cutting HTTP concerns
(auth, payload limit, CORS, errors in the route's dialect), health and metrics.
The dialects' routes live in gateway/openai, gateway/anthropic and gateway/tgi."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from switchyard.core.engine.client import EngineClient
from switchyard.core.params import ValidationError

from .drain import Drain, StreamDrain
from .errors import ErrorKind, GatewayError, InternalErrors, dialect_for_path, from_http_status
from .guard import BodyGuard
from .health import health_response
from .metrics import Metrics
from .service import GenerationService
from .settings import ServerSettings

logger = logging.getLogger("switchyard.gateway")


def create_app(settings: ServerSettings, client: EngineClient) -> FastAPI:
    metrics = Metrics()
    service = GenerationService(client, settings, metrics)
    client.on_step = lambda stats: metrics.observe_step(stats, client.info.block_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        watcher = asyncio.create_task(_report_engine(client))
        grpc_server = None
        try:
            grpc_server = await _start_grpc(app)
            yield
        finally:
            watcher.cancel()
            if grpc_server is not None:
                await grpc_server.stop()
            await client.shutdown()
            if tracing is not None:
                tracing.shutdown()  # flushes the last spans (the engine flushes its own as it stops)

    app = FastAPI(title="Switchyard", version=settings.version, lifespan=lifespan)
    app.state.settings = settings
    app.state.service = service
    app.state.models = None  # with several models, serve.py's ModelRegistry (gateway/models_registry.py)
    app.state.metrics = metrics
    app.state.drain = _install_body_checks(app, settings)
    if settings.cors_allow_origin:  # outermost: the guard's own errors carry CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origin),
                           allow_methods=["*"], allow_headers=["*"])
    app.state.tracing = tracing = _install_tracing(app, settings)
    _install_error_handlers(app)
    _install_common_routes(app, service, metrics)
    from .anthropic.routes import router as anthropic_router
    from .lora.routes import router as lora_router
    from .openai.routes import router as openai_router
    from .sglang_worker import router as sglang_router
    from .tgi.routes import router as tgi_router

    app.include_router(anthropic_router)  # /v1/messages: Anthropic's dialect, errors in its shape
    app.include_router(openai_router)
    app.include_router(lora_router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.include_router(sglang_router)  # before TGI's: its /generate serves both bodies
    app.include_router(tgi_router)
    return app


async def _report_engine(client: EngineClient) -> None:
    """Logs when the engine is ready, and why it failed (at start-up or later). The server
    answers 503 meanwhile; `switchyard serve` stops on the failure (serve.DrainingServer)."""
    try:
        await client.wait_ready()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - logged; the server stops on client.failure
        logger.error("the engine failed to start: %s", exc)
        return
    logger.info("ready: serving %s", client.info.backend if client.info else "")
    error = await client.wait_failure()
    logger.error("the engine stopped serving: %s", error)


async def _start_grpc(app: FastAPI):
    """--grpc-port: TGIS's gRPC API on this event loop (gateway/grpc/server.py), or None."""
    settings = app.state.settings
    if settings.grpc_port is None:
        return None
    from .grpc.server import GrpcServer  # needs the grpc extra: only imported when asked for

    server = GrpcServer(app.state.service, app.state.drain, settings.hostname, settings.grpc_port)
    await server.start()
    return server


def _install_tracing(app: FastAPI, settings: ServerSettings):
    """--otlp-endpoint: a span per inference request (gateway/tracing.py), outermost, so it
    covers the whole response; None (and nothing of opentelemetry imported) when off."""
    if not settings.tracing.enabled:
        return None
    from .tracing import GatewayTracing, TracingMiddleware  # the tracing extra: imported only when asked for

    tracing = GatewayTracing.start(settings.tracing)
    app.add_middleware(TracingMiddleware, tracing=tracing)
    return tracing


def _install_body_checks(app: FastAPI, settings: ServerSettings) -> Drain:
    """Outermost first (inside CORS): streams end at the drain deadline; bodies are checked
    (size, UTF-8, depth, surrogates) before any route or auth runs; a route's escaped
    exception is a 500 in its dialect."""
    drain = Drain(settings.graceful_shutdown_s)
    app.add_middleware(InternalErrors)
    app.add_middleware(BodyGuard, limit=settings.payload_limit)
    app.add_middleware(StreamDrain, drain=drain)
    return drain


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {msg}", None
    return (f"{field}: {msg}" if field else msg), field


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError):
        return exc.render(dialect_for_path(request.url.path))

    @app.exception_handler(ValidationError)
    async def core_validation_error(request: Request, exc: ValidationError):
        return GatewayError(ErrorKind.VALIDATION, str(exc), exc.param).render(dialect_for_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def body_validation_error(request: Request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return GatewayError(ErrorKind.VALIDATION, message, field).render(dialect_for_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif message == HTTPStatus(exc.status_code).phrase:  # the framework's own: say what it means
            message = _HTTP_MESSAGES.get(exc.status_code, message)
        error = from_http_status(exc.status_code, message, dict(exc.headers or {}) or None)
        return error.render(dialect_for_path(request.url.path))
    # an exception a route lets escape: errors.InternalErrors (a middleware) renders it


_HTTP_MESSAGES = {404: "no such route", 400: "the body could not be read"}


def _install_common_routes(app: FastAPI, service: GenerationService, metrics: Metrics) -> None:
    async def health() -> Response:
        return health_response(service.client)

    app.add_api_route("/health", health, methods=["GET"], include_in_schema=True)
    app.add_api_route("/ping", health, methods=["GET"])

    @app.get("/metrics")
    async def metrics_route() -> Response:
        load = service.client.load
        if load is not None:  # the engine's state now, not as of its last step (it may be idle)
            metrics.observe_load(load, service.client.info.block_size)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict:
        return {"version": service.settings.version}
