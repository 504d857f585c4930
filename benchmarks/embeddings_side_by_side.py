"""Embeddings throughput: llama.cpp's `llama-server --embedding` and `switchyard serve` on the same
GGUF embedding file, one after the other (never both at once), at batch 32 (issue 39, item 4).

    python benchmarks/embeddings_side_by_side.py [--gguf FILE] [--requests 8] [--batch 32]

The embedding file is made once from a generative GGUF (default: the default model, SmolLM2-135M
Q4_1) by copying it with llama.cpp's `{arch}.pooling_type` added (`--pooling`, default last), so
that both servers read the same pooling from the file: llama-server pools and L2-normalises it,
Switchyard's `--task auto` serves it for embeddings for that key (core/pooling/decide.py). It is
kept in ~/.cache/switchyard/bench/, so Switchyard's one-time metadata conversion is paid once.

Each server answers `--requests` POST /v1/embeddings of `--batch` texts each (one request at a
time, as a client embedding a corpus does), after `--warmup` such requests; the texts are the
same for both (seeded, 8 to 48 words). Reported per server: inputs/s and prompt tokens/s (each
server's own `usage.prompt_tokens`: the tokenizers are the same file's), and the ratio
Switchyard / llama-server; then the mean cosine between the two servers' embeddings of the same
texts (their arithmetic differs: a sanity check, not a parity test).

llama-server: `-t T -tb T -c 4096 -np BATCH -b 2048 -ub 2048 --embedding --no-webui` (LLAMA_BIN,
default ~/.cache/switchyard-peers/llama-server-build/bin/llama-server). Switchyard: `switchyard
serve --model-id FILE --max-batch-total-tokens 4096 --max-batch-size 64` + `--switchyard-args`.
The figures of a shared machine are noisy: run it on an idle one for numbers to quote."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

PEERS = os.path.expanduser("~/.cache/switchyard-peers")
WORDS = ("the quick brown fox jumps over lazy dog embeddings map text to vectors a server batches many "
         "requests into one step of the model and pools each prompt into one vector that search ranks").split()
POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}


def embedding_gguf(source: str, pooling: str, cache: str) -> str:
    """`source` copied with `{arch}.pooling_type` set (made once, then reused)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, f"{os.path.splitext(os.path.basename(source))[0]}.{pooling}-pooling.gguf")
    if os.path.isfile(target):
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    staging = f"{target}.{os.getpid()}.partial"
    writer = gguf.GGUFWriter(staging, arch=arch, endianess=reader.endianess)
    key = gguf.Keys.LLM.POOLING_TYPE.format(arch=arch)
    copy_with_new_metadata(reader, writer, {key: MetadataDetails(gguf.GGUFValueType.UINT32,
                                                                 POOLING_TYPES[pooling])}, [])
    os.replace(staging, target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 48))) + f" ({i})" for i in range(count)]


def start(command: list[str], url: str, log_path: str, timeout: float) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{command[0]} was not healthy after {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    """The server and what it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(url: str, batches: list[list[str]], warmup: int) -> dict:
    """Sequential requests of one batch each; throughput over the measured ones."""
    with httpx.Client(timeout=600) as client:
        def post(batch):
            response = client.post(url + "/v1/embeddings", json={"input": batch, "model": "default",
                                                                 "encoding_format": "float"})
            response.raise_for_status()
            return response.json()

        for batch in batches[:warmup]:
            post(batch)
        vectors, tokens = [], 0
        started = time.perf_counter()
        for batch in batches[warmup:]:
            body = post(batch)
            tokens += body["usage"]["prompt_tokens"]
            vectors += [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
        seconds = time.perf_counter() - started
    inputs = sum(len(b) for b in batches[warmup:])
    return {"inputs": inputs, "tokens": tokens, "seconds": seconds, "inputs_per_s": inputs / seconds,
            "tokens_per_s": tokens / seconds, "vectors": np.array(vectors, dtype=np.float32)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a generative GGUF to make the embedding file from "
                        "(default: the default model)")
    parser.add_argument("--pooling", choices=sorted(POOLING_TYPES), default="last")
    parser.add_argument("--batch", type=int, default=32, help="texts per request")
    parser.add_argument("--requests", type=int, default=8, help="measured requests per server")
    parser.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server threads")
    parser.add_argument("--servers", default="llama,switchyard")
    parser.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", os.path.join(
        PEERS, "llama-server-build", "bin", "llama-server")))
    parser.add_argument("--llama-context", type=int, default=4096, help="llama-server's -c: its KV cells, shared "
                        "by its --batch slots (each of its tokens attends over them all, masked)")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    parser.add_argument("--switchyard-args", default="", help="more `switchyard serve` flags, one string")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/switchyard/bench"))
    parser.add_argument("--load-timeout", type=float, default=900)
    parser.add_argument("--results", default=None, help="append a JSON line of the figures here")
    args = parser.parse_args()

    if args.gguf is None:
        from switchyard.core.loader import default_model_path

        args.gguf = default_model_path()
    model = embedding_gguf(args.gguf, args.pooling, args.cache)
    batches = [texts(args.batch, seed) for seed in range(args.warmup + args.requests)]
    commands = {
        "llama": [args.llama_bin, "-m", model, "--embedding", "--host", "127.0.0.1", "-t", str(args.threads),
                  "-tb", str(args.threads), "-c", str(args.llama_context), "-np", str(args.batch), "-b", "2048",
                  "-ub", "2048", "--no-webui", *args.llama_args.split()],
        "switchyard": [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--model-id", model,
                       "--hostname", "127.0.0.1", "--max-batch-total-tokens", "4096", "--max-batch-size", "64",
                       *args.switchyard_args.split()],
    }
    results = {}
    for name in args.servers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = os.path.join(args.cache, f"{name}.log")
        print(f"{name}: starting ({log})", flush=True)
        proc = start(commands[name] + ["--port", str(port)], url, log, args.load_timeout)
        try:
            results[name] = measure(url, batches, args.warmup)
        finally:
            stop(proc)
        r = results[name]
        print(f"{name}: {r['inputs']} inputs, {r['tokens']} prompt tokens in {r['seconds']:.2f} s: "
              f"{r['inputs_per_s']:.1f} inputs/s, {r['tokens_per_s']:.0f} tokens/s", flush=True)
    cpu = _cpu_name()
    print(f"\nmodel {os.path.basename(model)} ({args.pooling} pooling), batch {args.batch}, "
          f"{args.requests} requests, {len(os.sched_getaffinity(0))} CPUs: {cpu}")
    print(f"{'server':<12}{'inputs/s':>10}{'tokens/s':>10}")
    for name, r in results.items():
        print(f"{name:<12}{r['inputs_per_s']:>10.1f}{r['tokens_per_s']:>10.0f}")
    line = {"model": os.path.basename(model), "batch": args.batch, "requests": args.requests, "cpu": cpu,
            **{f"{n}_{k}": round(r[k], 2) for n, r in results.items() for k in ("inputs_per_s", "tokens_per_s")}}
    if {"llama", "switchyard"} <= set(results):
        ratio = results["switchyard"]["tokens_per_s"] / results["llama"]["tokens_per_s"]
        a, b = results["switchyard"]["vectors"], results["llama"]["vectors"]
        cosine = float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).mean())
        print(f"ratio switchyard / llama-server (tokens/s): {ratio:.2f}")
        print(f"mean cosine between the two servers' embeddings: {cosine:.4f}")
        line.update(ratio=round(ratio, 3), mean_cosine=round(cosine, 5))
    if args.results:
        with open(args.results, "a") as file:
            file.write(json.dumps(line) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return next(line.split(":", 1)[1].strip() for line in file if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
