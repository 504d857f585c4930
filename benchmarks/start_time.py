"""Cached start-up, side by side: seconds from launching `switchyard serve` to the port answering
(any status) and to /health answering 200, over several starts after one untimed start that
fills the caches (kernels, converted GGUF, engine environment); and the same for llama.cpp's
llama-server on the same GGUF file where --llama-server is given.

    python benchmarks/start_time.py --starts 3 [--llama-server PATH] [--model FILE.gguf] [-- serve flags]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from switchyard.core.testing.serving import free_port


def timed_start(command: list[str], port: int, timeout: float = 300.0) -> tuple[float | None, float]:
    """(seconds to the first HTTP answer, seconds to /health 200) of one start; stops it after."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    try:
        while time.monotonic() - started < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return first if first is not None else time.monotonic() - started, time.monotonic() - started
            except urllib.error.HTTPError:
                first = first if first is not None else time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"not healthy within {timeout} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def default_gguf() -> str:
    from switchyard.core.loader.source import resolve_source
    from switchyard.core.config import ModelConfig

    return resolve_source(ModelConfig()).path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=3, help="timed starts of each server")
    parser.add_argument("--model", default=None, help="the model both serve (default: the default model's GGUF)")
    parser.add_argument("--llama-server", default=None, help="llama-server binary, to time beside Switchyard")
    parser.add_argument("serve_flags", nargs="*", help="more `switchyard serve` flags (after --)")
    args = parser.parse_args()
    servers = {}
    port = free_port()
    serve = [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port), "--hostname", "127.0.0.1",
             "--max-batch-total-tokens", "4096", *(["--model-id", args.model] if args.model else []), *args.serve_flags]
    servers["switchyard"] = serve
    if args.llama_server:
        servers["llama-server"] = [args.llama_server, "-m", args.model or default_gguf(), "--host", "127.0.0.1",
                                   "--port", str(port), "-c", "4096", "-t", "2"]
    for name, command in servers.items():
        timed_start(command, port)  # fills the caches; not timed
        runs = [timed_start(command, port) for _ in range(args.starts)]
        firsts = [first for first, _ in runs]
        healthy = [ready for _, ready in runs]
        print(f"{name:<13} first answer {statistics.median(firsts):6.2f} s   /health 200 "
              f"{statistics.median(healthy):6.2f} s (median of {args.starts}: "
              f"{', '.join(f'{s:.2f}' for s in healthy)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
