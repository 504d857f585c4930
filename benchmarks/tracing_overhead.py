"""What OpenTelemetry tracing costs a server: streamed tokens per second with tracing off and
on (--otlp-endpoint, exporting to a real OTLP gRPC receiver in this process).

    python benchmarks/tracing_overhead.py [--requests 32] [--concurrency 16] [--tokens 64] [--rounds 3]

A random-weight toy Llama (steps take about a millisecond), so the gateway's and the engine
loop's own work per request, step and token is as large a share of the time as it can be:
the worst case for an overhead. The engine runs in a thread of this process
(InProcessEngineClient), the same loop as the engine process, behind the real app and a real
uvicorn server; each round runs off, then on, and the best round of each is printed. Needs the
`tracing` extra and opentelemetry-proto + grpcio (the `test` extra) for the receiver."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from concurrent import futures

import httpx
import uvicorn

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TracingConfig
from switchyard.gateway.app import create_app
from switchyard.gateway.serve import DrainingServer
from switchyard.gateway.settings import ServerSettings


class Receiver:
    """An OTLP gRPC TraceService that counts the spans it receives."""

    def __init__(self):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self
        self.spans = 0

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the proto's name
                receiver.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def tiny_engine():
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.loader import load_tokenizer

    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"),
                          cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64))
    tokenizer = load_tokenizer(config.model)
    return EngineCore(config, tokenizer=tokenizer), tokenizer


def start_server(tracing: TracingConfig):
    client = InProcessEngineClient(tiny_engine, tracing=tracing)
    client.start()
    asyncio.run(client.wait_ready(timeout=300))
    app = create_app(ServerSettings(model_id="tiny", tracing=tracing, max_concurrent_requests=1024), client)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"),
                            app.state.drain)
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
        asyncio.run(client.shutdown())
        if app.state.tracing is not None:
            app.state.tracing.shutdown()

    return f"http://127.0.0.1:{port}", stop


async def load(url: str, requests: int, concurrency: int, tokens: int) -> tuple[int, float]:
    """(tokens streamed, seconds) for `requests` streams, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    body = {"inputs": "Tracing overhead", "parameters": {"max_new_tokens": tokens, "do_sample": True, "seed": 1}}

    async def one(http: httpx.AsyncClient, i: int) -> int:
        async with gate:
            count = 0
            headers = {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}
            async with http.stream("POST", url + "/generate_stream", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and json.loads(line[5:])["token"]:
                        count += 1
            return count

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as http:
        await one(http, 0)  # warm
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(http, i) for i in range(requests)))
        return sum(counts), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    receiver = Receiver()
    modes = {"off": TracingConfig(), "on": TracingConfig(otlp_endpoint=receiver.endpoint)}
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, tracing in modes.items():
            url, stop = start_server(tracing)
            try:
                tokens, seconds = asyncio.run(load(url, args.requests, args.concurrency, args.tokens))
            finally:
                stop()
            rate = tokens / seconds
            best[name] = max(best.get(name, 0.0), rate)
            print(f"round {round_ + 1} tracing {name:3}: {tokens} tokens in {seconds:.2f} s = {rate:.0f} tok/s")
    print(f"best: off {best['off']:.0f} tok/s, on {best['on']:.0f} tok/s "
          f"({100 * (best['on'] / best['off'] - 1):+.1f}%); {receiver.spans} spans received")
    receiver.server.stop(None)


if __name__ == "__main__":
    main()
