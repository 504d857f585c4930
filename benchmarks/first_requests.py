"""What the first requests of a fresh server pay: the time to first token of each of N requests
sent one after another (distinct short chat prompts, streamed) right after /health first answers
200, and the first's TTFT over the tenth's. A server that is warm when ready gives a ratio near 1
(issue 37's aim: at most 1.5). With --llama-server the same for llama.cpp's server on the same
file, one server at a time.

    python benchmarks/first_requests.py [--requests 12] [--model FILE.gguf] [--llama-server PATH] [-- serve flags]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

from switchyard.core.testing.serving import free_port

PROMPTS = ["Name a fruit.", "What is two plus two?", "Say hello in French.", "Name a colour.", "What is a cat?",
           "Count to three.", "Name a planet.", "What is rain?", "Name a city.", "What day follows Monday?",
           "Name a tree.", "What is ice?", "Name a river.", "What is a bird?", "Name a metal.", "What is sand?"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not become healthy")


def model_id(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as answer:
        return json.load(answer)["data"][0]["id"]


def ttft(port: int, prompt: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content delta."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                       "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=300) as answer:
        for line in answer:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line.replace(b": ", b":"):
                first = time.perf_counter() - started
    return first if first is not None else float("nan")


def measure(name: str, command: list[str], port: int, requests: int) -> list[float]:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        model = model_id(port)
        times = [ttft(port, PROMPTS[i % len(PROMPTS)], model) for i in range(requests)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    tenth = times[min(9, len(times) - 1)]
    print(f"{name}: TTFT ms " + " ".join(f"{t * 1e3:.0f}" for t in times)
          + f" | first / tenth {times[0] / tenth:.2f}, max of first four / tenth {max(times[:4]) / tenth:.2f}")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--llama-server", default=None, help="llama-server binary to measure on the same file")
    parser.add_argument("serve_args", nargs="*", help="extra `switchyard serve` flags (after --)")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port), "--hostname", "127.0.0.1",
               *(["--model-id", args.model] if args.model else []), *args.serve_args]
    measure("switchyard", command, port, args.requests)
    if args.llama_server:
        if not args.model:
            parser.error("--llama-server needs --model")
        port = free_port()
        measure("llama-server", [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                                 "-t", "2", "-tb", "2", "-c", "16384", "-np", "32", "-cb", "--no-webui"],
                port, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
