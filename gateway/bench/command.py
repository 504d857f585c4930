"""`switchyard bench serve`: flags, and the order of runs.

Servers run one after another, never at once (they would share the cores); each gets its
warm-up, then one run per concurrency, lowest first. Every finished run is printed, written
to `--output` at once (a later failure keeps it) and, at the end, all go in one table."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .figures import RunResult, summarize
from .loadgen import drive, make_client, served_model
from .memory import ServerMemory
from .progress import Progress
from .report import comparison_table, read_results, run_line, throughput_matrix, to_json
from .workload import Server, Workload, chat_bodies

CHAT_PATH = "/v1/chat/completions"
DEFAULT_URL = "http://127.0.0.1:8080"
LOADING_POLL_S = 1.0  # between warm-ups while a server answers 503 (loading)
DESCRIPTION = """Drives OpenAI-compatible servers (Switchyard, llama.cpp's llama-server, vLLM, ...) with
streaming /v1/chat/completions clients at each concurrency, greedy, the output length forced
(max_tokens, min_tokens, ignore_eos), over a fixed prompt set, after a few warm-up requests.
Prints output tok/s (from the stream's usage, else counted chunks), req/s, TTFT and ITL
p50/p90/p99, errors and, for a server on this machine, its peak RSS (VmHWM of its process
and those below it, summed). With --compare the servers run one after another, never at
once, and one table gives each server's ratio to the first."""


class BenchError(RuntimeError):
    """A server could not be benchmarked (unreachable, no model, every warm-up failed)."""


def _concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be integers >= 1")
    return tuple(sorted(set(values)))


def _server(text: str) -> Server:
    try:
        return Server.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_command(commands) -> None:
    """Registers `bench serve` on the `switchyard` subcommands."""
    bench = commands.add_parser("bench", help="benchmark OpenAI-compatible servers side by side")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="drive running servers with streaming chat clients",
                             description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = serve.add_mutually_exclusive_group()
    targets.add_argument("--url", type=_server, default=None,
                         help=f"the server to drive, [label=]URL (default {DEFAULT_URL})")
    targets.add_argument("--compare", type=_server, nargs="+", metavar="[LABEL=]URL",
                         help="several servers, run one after another; the first is the ratio's baseline")
    serve.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    serve.add_argument("--concurrency", type=_concurrencies, default=(1, 8, 32, 64), help="e.g. 1,8,32,64")
    serve.add_argument("--output-len", type=int, default=128,
                       help="forced output tokens (max_tokens, min_tokens and ignore_eos)")
    serve.add_argument("--num-prompts", type=int, default=None,
                       help="requests per concurrency (default: 4 x concurrency, at least 8)")
    serve.add_argument("--workload", choices=("chat", "grounded", "shared-prefix"), default="chat",
                       help="chat: short prompts, outputs forced to --output-len; grounded: 300-800-token inputs "
                       "whose answer repeats them (rename a variable, a document as JSON), outputs up to "
                       "--output-len, where speculative decoding (--speculate) gains; shared-prefix: 8 system "
                       "prompts of ~1,000 tokens in turn, outputs forced, where replicas' prefix affinity gains")
    serve.add_argument("--warmup", type=int, default=2, help="untimed requests per server before the runs")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    serve.add_argument("--output", type=Path, default=None, help="write every run to this JSON-lines file")
    targets.add_argument("--results", type=Path, nargs="+", default=None,
                         help="print (and plot) these results files instead of running")
    serve.add_argument("--plot", type=Path, default=None, metavar="DIR",
                       help="write throughput.png, ttft.png and itl.png here (needs matplotlib)")
    serve.set_defaults(run=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    """The command: 0 when every run finished without errors, 1 otherwise, 2 for bad usage."""
    if args.plot is not None:
        from .plot import PlotUnavailable, load_pyplot
        try:
            load_pyplot()
        except PlotUnavailable as exc:
            print(f"switchyard: error: {exc}", file=sys.stderr)
            return 2
    if args.results:
        try:
            results, failed = read_results(args.results), False
        except (OSError, ValueError) as exc:
            print(f"switchyard: error: {exc}", file=sys.stderr)
            return 2
    else:
        servers = args.compare or [args.url or Server.parse(DEFAULT_URL)]
        workload = Workload(concurrencies=args.concurrency, output_len=args.output_len,
                            num_prompts=args.num_prompts, warmup=args.warmup, timeout_s=args.timeout,
                            api_key=args.api_key, kind=args.workload)
        results, failed = _run_all(servers, workload, args.model, args.output)
    print(comparison_table(results))
    if len({r.concurrency for r in results}) > 1:
        print()
        print(throughput_matrix(results))
    if args.plot is not None and results:
        from .plot import write_plots
        for path in write_plots(results, args.plot):
            print(f"wrote {path}")
    return 1 if failed or any(r.errors for r in results) else 0


def _run_all(servers: Sequence[Server], workload: Workload, model: str | None,
             output: Path | None) -> tuple[list[RunResult], bool]:
    """Every server in turn; a server that cannot be benchmarked is reported and skipped."""
    results: list[RunResult] = []
    sink = output.open("w") if output is not None else None
    failed = False

    def keep(result: RunResult) -> None:
        results.append(result)
        print(run_line(result), flush=True)
        if sink is not None:
            sink.write(to_json(result) + "\n")
            sink.flush()

    try:
        for server in servers:
            try:
                asyncio.run(bench_server(server, workload, model, keep))
            except BenchError as exc:
                failed = True
                print(f"{server.label}: {exc}", file=sys.stderr)
    finally:
        if sink is not None:
            sink.close()
    return results, failed


async def bench_server(server: Server, workload: Workload, model: str | None,
                       on_result: Callable[[RunResult], None]) -> None:
    """Warm-up, then one run per concurrency; each result goes to `on_result` as it ends."""
    import httpx

    async with make_client(server.url, max(workload.concurrencies), workload.timeout_s, workload.api_key) as client:
        try:
            model = model or await served_model(client)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            raise BenchError(f"cannot list the models of {server.url}: {exc}") from None
        await _warm_up(client, workload, model)
        memory = ServerMemory.find(server.url)
        for concurrency in workload.concurrencies:
            bodies = chat_bodies(model, workload.requests_at(concurrency), workload.output_len, kind=workload.kind)
            progress = Progress(f"{server.label} c={concurrency}", len(bodies))
            try:
                records, wall = await drive(client, CHAT_PATH, bodies, concurrency,
                                            on_done=lambda record: progress.advance(record.ok))
            finally:
                progress.close()
            on_result(summarize(server.label, server.url, model, concurrency, workload.output_len, records, wall,
                                memory.peak_rss_bytes()))


async def _warm_up(client, workload: Workload, model: str) -> None:
    """`warmup` short requests at once, not measured. While the server answers every one with
    503 (a model still loading) they are sent again, for up to the request timeout; all of
    them failing otherwise stops this server's runs."""
    if workload.warmup <= 0:
        return
    bodies = chat_bodies(model, workload.warmup, min(workload.output_len, workload.warmup_len), kind=workload.kind)
    deadline = time.monotonic() + workload.timeout_s
    while True:
        records, _ = await drive(client, CHAT_PATH, bodies, workload.warmup)
        if any(r.ok for r in records):
            return
        if not all(r.error.startswith("HTTP 503") for r in records) or time.monotonic() > deadline:
            raise BenchError(f"every warm-up request failed: {records[0].error}")
        await asyncio.sleep(LOADING_POLL_S)
