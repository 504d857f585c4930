"""`switchyard serve --grpc-port`: the gRPC API started by the app's lifespan on uvicorn's
event loop, its health following the engine, and SIGTERM letting an open stream finish."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.gateway.grpc.proto import generation_pb2 as pb
from switchyard.gateway.grpc.proto import generation_pb2_grpc as pb_grpc

from switchyard.core.testing.serving import free_port
from test_serve import _start, _wait_healthy


def _health(channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


@pytest.mark.slow
def test_serve_grpc_port_streams_and_drains():
    grpc_port = free_port()
    proc, url = _start("--max-batch-total-tokens", "4096", "--graceful-shutdown-timeout", "300",
                       "--grpc-port", str(grpc_port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            _wait_healthy(proc, url)
            # gRPC health follows the engine's readiness on its own task (polled every 50 ms)
            deadline = time.monotonic() + 5
            while _health(channel) != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.GenerationServiceStub(channel)
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text="Count from one to fifty:"),
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=60)))
            messages, errors = [], []

            def stream():
                try:
                    messages.extend(m for m in stub.GenerateStream(request, timeout=300))
                except Exception as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)

            reader = threading.Thread(target=stream)
            reader.start()
            while len(messages) < 2 and reader.is_alive():
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            assert _health(channel) != health_pb2.HealthCheckResponse.SERVING  # draining (or already gone)
            reader.join(300)
            assert not errors
            assert messages[-1].stop_reason == pb.MAX_TOKENS and messages[-1].generated_token_count == 60
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_taken_grpc_port_is_a_one_line_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(free_port()),
                                 "--grpc-port", str(taken.getsockname()[1])],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--grpc-port" in result.stderr
