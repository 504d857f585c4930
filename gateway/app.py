"""FastAPI app factory: the engine client's life cycle, cross-cutting HTTP concerns
(auth, payload limit, CORS, errors in the route's dialect), health and metrics.
The dialects' routes live in gateway/openai and gateway/tgi."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from switchyard.core.client import EngineClient
from switchyard.core.params import ValidationError

from .errors import ErrorKind, GatewayError, SafeJSONResponse, dialect_for_path
from .metrics import Metrics
from .service import GenerationService
from .settings import ServerSettings

logger = logging.getLogger("switchyard.gateway")


def create_app(settings: ServerSettings, client: EngineClient) -> FastAPI:
    metrics = Metrics()
    service = GenerationService(client, settings, metrics)
    if hasattr(client, "on_step"):
        client.on_step = lambda stats: metrics.observe_step(stats, client.info.block_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        watcher = asyncio.create_task(_exit_if_start_fails(client))
        try:
            yield
        finally:
            watcher.cancel()
            await client.shutdown()

    app = FastAPI(title="Switchyard", version=settings.version, lifespan=lifespan)
    app.state.settings = settings
    app.state.service = service
    app.state.metrics = metrics
    if settings.cors_allow_origin:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origin),
                           allow_methods=["*"], allow_headers=["*"])
    _install_payload_limit(app, settings)
    _install_error_handlers(app)
    _install_common_routes(app, service, metrics)
    from .openai.routes import router as openai_router
    from .tgi.routes import router as tgi_router

    app.include_router(openai_router)
    app.include_router(tgi_router)
    return app


async def _exit_if_start_fails(client: EngineClient) -> None:
    """The server answers /health with 503 while the model loads; if loading fails,
    it stops (as on SIGTERM) and `switchyard serve` exits non-zero."""
    try:
        await client.wait_ready()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - logged, then the process stops
        logger.error("the engine failed to start: %s", exc)
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        logger.info("ready: serving %s", client.info.backend if client.info else "")


def require_api_key(request: Request) -> None:
    """Dependency of every inference route: `Authorization: Bearer <--api-key>`."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise GatewayError(ErrorKind.AUTHENTICATION, "invalid or missing API key (Authorization: Bearer ...)")


def _install_payload_limit(app: FastAPI, settings: ServerSettings) -> None:
    app.add_middleware(PayloadLimit, limit=settings.payload_limit)


class PayloadLimit:
    """413 for a body over --payload-limit, from its content-length or as it arrives.

    Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware
    hands the app a `receive` that reports a disconnect once the body is read, which
    would cancel every stream after its first event."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._reject(scope, receive, send, int(length))
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise GatewayError(ErrorKind.PAYLOAD_TOO_LARGE,
                                       f"the body is over the limit of {self.limit} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _reject(self, scope, receive, send, length: int) -> None:
        error = GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, f"the body has {length} bytes; the limit is {self.limit}")
        await error.render(dialect_for_path(scope["path"]))(scope, receive, send)


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
        kind = {404: ErrorKind.NOT_FOUND, 413: ErrorKind.PAYLOAD_TOO_LARGE}.get(exc.status_code)
        if kind is None:
            return PlainTextResponse(str(exc.detail), status_code=exc.status_code)
        return GatewayError(kind, str(exc.detail)).render(dialect_for_path(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return GatewayError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}").render(
            dialect_for_path(request.url.path))


def health_response(client: EngineClient) -> Response:
    """200 once warmed up; TGI's 503 body before that (/health, /ping, GET /)."""
    if not client.ready:
        return SafeJSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, 503)
    return Response(status_code=200)


def _install_common_routes(app: FastAPI, service: GenerationService, metrics: Metrics) -> None:
    async def health() -> Response:
        return health_response(service.client)

    app.add_api_route("/health", health, methods=["GET"], include_in_schema=True)
    app.add_api_route("/ping", health, methods=["GET"])

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict:
        return {"version": service.settings.version}
