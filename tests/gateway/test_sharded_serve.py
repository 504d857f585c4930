"""`switchyard serve --num-shard 2` as a user runs it: it answers, and a shard that dies
mid-stream is TGI's "Shard N terminated": the stream ends with an error event, /health
stops answering 200, the server exits non-zero with the shard's end in its log, and no
process of the engine or its shards is left behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from test_engine_process_serve import _children, _engine_pid, _gone, _loads_torch
from test_serve import _start, _wait_healthy

SHARDED = ("--model-id", "llama-tiny", "--load-format", "dummy", "--num-shard", "2",
           "--max-batch-total-tokens", "2048")


@pytest.mark.slow
def test_a_killed_shard_ends_the_stream_and_the_server_with_its_name():
    proc, url = _start(*SHARDED)
    try:
        _wait_healthy(proc, url, timeout=600)
        answer = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        engine = _engine_pid(proc.pid)
        shards = [pid for pid in _children(engine) if _loads_torch(pid)]
        assert len(shards) == 1, shards  # rank 1; rank 0 is the engine process itself
        descendants = _children(proc.pid)
        events: list[dict] = []
        first = threading.Event()

        def stream():
            body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        events.append(json.loads(line[5:]))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(120)
        os.kill(shards[0], signal.SIGKILL)
        reader.join(60)
        assert "error" in events[-1] and "Shard 1 terminated" in json.dumps(events[-1]), events[-1]
        health = []
        while proc.poll() is None and len(health) < 100:
            try:
                health.append(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert 200 not in health  # 503 until the server has exited
        assert proc.wait(60) == 1  # non-zero, and not its own SIGTERM (-15): Restart=on-failure restarts it
        assert "Shard 1 terminated: killed by signal SIGKILL" in proc.stdout.read()
        assert not _gone(descendants, 15), "processes were left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
