"""The gRPC server: a `grpc.aio` server on the HTTP server's own event loop and process,
serving `fmaas.GenerationService` (servicer.py), `grpc.health.v1.Health` and server
reflection (v1alpha, which grpcurl and Postman ask for) on --hostname:--grpc-port.

Health follows the engine: NOT_SERVING while the model loads, SERVING once it is ready,
NOT_SERVING for good once it fails or the server drains; both the overall status ("") and
`fmaas.GenerationService` are reported. Messages are bounded by --payload-limit, as HTTP
bodies are. Started and stopped by the app's lifespan (gateway/app.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..drain import Drain
from ..service import GenerationService
from .proto import generation_pb2 as pb
from .proto import generation_pb2_grpc as pb_grpc
from .servicer import GenerationServicer

logger = logging.getLogger("switchyard.gateway.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # fmaas.GenerationService
_HEALTH_NAMES = ("", SERVICE_NAME)


class GrpcServer:
    """One gRPC server bound to `host:port` (port 0: a free one, see `port` once started)."""

    def __init__(self, service: GenerationService, drain: Drain, host: str, port: int):
        self.service = service
        self.drain = drain
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        limit = self.service.settings.payload_limit
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                          ("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self.service, self.drain), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        where = f"[{self.host}]" if ":" in self.host else self.host
        try:
            self.port = server.add_insecure_port(f"{where}:{self.requested_port}")
        except RuntimeError as exc:  # grpcio raises when the address cannot be bound
            raise OSError(f"cannot listen on {self.host}:{self.requested_port} (--hostname, --grpc-port): "
                          f"{exc}") from None
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self._watch = asyncio.create_task(self._follow_engine())
        logger.info("gRPC (fmaas.GenerationService, health, reflection) listening on %s:%d", where, self.port)

    async def stop(self) -> None:
        """Stop serving: RPCs still open get until the drain deadline (if draining), then are cancelled."""
        if self._server is None:
            return
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()
        grace = max(0.0, self.drain.deadline - time.monotonic()) if self.drain.deadline is not None else 0.0
        await self._server.stop(grace)
        self._server = None

    async def _set_all(self, status) -> None:
        for name in _HEALTH_NAMES:
            await self.health.set(name, status)

    async def _follow_engine(self) -> None:
        """SERVING once the engine is ready; NOT_SERVING for good when it fails or the server drains."""
        client = self.service.client
        draining = asyncio.ensure_future(self.drain.bind().wait())
        try:
            ready = asyncio.ensure_future(client.wait_ready())
            await asyncio.wait({ready, draining}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and ready.exception() is None and not draining.done():
                await self._set_all(health_pb2.HealthCheckResponse.SERVING)
                failed = asyncio.ensure_future(client.wait_failure())
                await asyncio.wait({failed, draining}, return_when=asyncio.FIRST_COMPLETED)
                failed.cancel()
            ready.cancel()
            await self.health.enter_graceful_shutdown()
        finally:
            draining.cancel()
