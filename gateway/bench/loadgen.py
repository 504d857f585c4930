"""The load generator: streaming requests, at most `concurrency` in flight, one record each.

Measurement rules (the same as the peer harness's, so figures compare):
- a request's clock starts just before it is sent; TTFT is the arrival of the first chunk
  carrying text, ITL the gaps between successive chunks carrying text;
- output tokens are the server's `usage.completion_tokens` when the stream carries usage
  (asked with `stream_options.include_usage`), else the number of chunks carrying text;
- a request is an error when the status is not 200, the stream carries an `error`
  event, or the transport fails; errors add no tokens and no latencies.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it (times from time.perf_counter)."""

    start: float
    end: float
    chunk_times: tuple[float, ...] = ()
    usage_tokens: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def tokens_source(self) -> str:
        return "usage" if self.usage_tokens is not None else "chunks"

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def _text_of(choice: dict) -> str:
    """The text a streamed choice carries: chat `delta` or completions `text`."""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""


class _StreamReader:
    """Folds the server-sent events of one response into chunk times, usage and errors."""

    def __init__(self):
        self.chunk_times: list[float] = []
        self.usage_tokens: int | None = None
        self.error = ""

    def feed(self, line: str) -> bool:
        """Takes one line; False once the stream says [DONE]."""
        if not line.startswith("data:"):
            return True
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return False
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            return True
        if event.get("error"):
            self.error = f"stream error: {str(event['error'])[:200]}"
        if any(_text_of(choice) for choice in event.get("choices") or ()):
            self.chunk_times.append(time.perf_counter())
        usage = event.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        return True


async def stream_one(client: httpx.AsyncClient, path: str, body: dict) -> RequestRecord:
    """Sends one streaming request and reads it to the end."""
    start = time.perf_counter()
    reader = _StreamReader()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestRecord(start, time.perf_counter(), error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not reader.feed(line):
                    break
    except (httpx.HTTPError, OSError) as exc:
        return RequestRecord(start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    return RequestRecord(start, time.perf_counter(), tuple(reader.chunk_times), reader.usage_tokens, reader.error)


async def drive(client: httpx.AsyncClient, path: str, bodies: Sequence[dict], concurrency: int,
                on_done: Callable[[RequestRecord], None] = lambda record: None) -> tuple[list[RequestRecord], float]:
    """Sends `bodies` in order with `concurrency` clients, each sending its next request as
    soon as its last one ends. Returns the records (in body order) and the wall time from
    the first send to the last end."""
    records: list[RequestRecord | None] = [None] * len(bodies)
    indices = iter(range(len(bodies)))

    async def client_loop():
        for index in indices:  # shared: each index is taken by one client
            records[index] = await stream_one(client, path, bodies[index])
            on_done(records[index])

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return [r for r in records if r is not None], time.perf_counter() - start


def make_client(base_url: str, concurrency: int, timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """An HTTP client with a connection per concurrent request and no proxy from the environment."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=base_url, limits=limits, headers=headers, trust_env=False,
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model id of the server's `/v1/models`."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{client.base_url} lists no model in /v1/models; pass --model")
    return models[0]["id"]
