"""`switchyard serve`: TGI's launcher flags (and their environment variables, read
when the command line is parsed, never at import) -> EngineConfig + ServerSettings."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Mapping

import uvicorn

from switchyard.core.config import GrammarConfig

from .settings import ServerSettings

logger = logging.getLogger("switchyard.serve")


def _env_default(environ: Mapping[str, str], names: tuple[str, ...], default, kind=str):
    for name in names:
        if environ.get(name) not in (None, ""):
            value = environ[name]
            if kind is bool:
                return value.lower() in ("1", "true", "yes", "on")
            return kind(value)
    return default


# (flag, env names, type, default, help) - TGI's names and defaults where they apply.
_SERVE_FLAGS = [
    # TGI reads HOSTNAME too, but shells and containers set it to the machine's name.
    ("--hostname", ("SWITCHYARD_HOSTNAME",), str, "127.0.0.1", "address to listen on"),
    ("--port", ("PORT",), int, 8080, "port to listen on"),
    ("--max-concurrent-requests", ("MAX_CONCURRENT_REQUESTS",), int, 128,
     "requests served at once; more get 429 at once"),
    ("--max-input-tokens", ("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"), int, None,
     "most prompt tokens (default: max-total-tokens - 1)"),
    ("--max-total-tokens", ("MAX_TOTAL_TOKENS",), int, None,
     "most prompt + generated tokens of one request (default: the model's context length)"),
    ("--max-batch-prefill-tokens", ("MAX_BATCH_PREFILL_TOKENS",), int, 2048, "token budget of one step"),
    ("--max-batch-total-tokens", ("MAX_BATCH_TOTAL_TOKENS",), int, None,
     "KV cache capacity in tokens (default: CPU, what --max-batch-size requests of the whole context can hold, "
     "at most 16,384 tokens' bytes in the model's dtype (or one whole-context request) or --kv-cache-memory; "
     "GPU, what --cuda-memory-fraction leaves; a quantized --kv-cache-dtype holds more in either)"),
    ("--max-batch-size", ("MAX_BATCH_SIZE",), int, 256, "most requests in the running batch"),
    ("--max-stop-sequences", ("MAX_STOP_SEQUENCES",), int, 4, "most stop sequences per request"),
    ("--max-top-n-tokens", ("MAX_TOP_N_TOKENS",), int, 5, "most top_n_tokens / top_logprobs"),
    ("--max-best-of", ("MAX_BEST_OF",), int, 2, "largest best_of"),
    ("--max-client-batch-size", ("MAX_CLIENT_BATCH_SIZE",), int, 4, "most prompts in one request"),
    ("--revision", ("REVISION",), str, None, "model revision in the Hugging Face cache (default: main)"),
    ("--mmproj", ("MMPROJ",), str, None,
     "llama.cpp's mmproj GGUF of a vision-language model (its vision tower and connector), served with the "
     "language model's GGUF given to --model-id, as llama-server's -m TEXT.gguf --mmproj MMPROJ.gguf; projector "
     "types served: idefics3 (Idefics3, SmolVLM), gemma3 (Gemma 3) (default: none: the model reads text only)"),
    ("--api-key", ("API_KEY",), str, None,
     "require Authorization: Bearer <key> on inference routes (default: none, every route open)"),
    ("--payload-limit", ("PAYLOAD_LIMIT",), int, 2_000_000, "largest request body in bytes"),
    ("--cuda-memory-fraction", ("CUDA_MEMORY_FRACTION",), float, None,
     "GPUs: the fraction of the device's memory this process may use; the KV cache gets what the weights and "
     "a largest step leave of it (default: 1.0, as TGI)"),
    ("--num-shard", ("NUM_SHARD",), int, 1, "number of shards (tensor parallelism), over every node"),
    # one `switchyard serve` per machine; the standard rendezvous variables are the defaults
    # (a job with one task per node sets WORLD_SIZE = nodes and RANK = this node's index)
    ("--nnodes", ("NNODES", "WORLD_SIZE"), int, 1, "machines the shards span"),
    ("--node-rank", ("NODE_RANK", "RANK"), int, 0,
     "this machine's index: 0 runs the server and rank 0, others only their shards"),
    ("--master-addr", ("MASTER_ADDR",), str, "127.0.0.1", "node 0's address (shard rendezvous)"),
    ("--master-port", ("MASTER_PORT",), int, None,
     "node 0's rendezvous port (default: a free port; required with --nnodes > 1)"),
    ("--waiting-served-ratio", ("WAITING_SERVED_RATIO",), float, 0.3,
     "for backends that cannot mix prefill and decode: prefill once waiting >= ratio x decoding"),
    ("--max-waiting-tokens", ("MAX_WAITING_TOKENS",), int, 20,
     "for backends that cannot mix prefill and decode: decode steps (+ 1) after which a prefill is forced"),
    ("--graceful-shutdown-timeout", ("GRACEFUL_SHUTDOWN_TIMEOUT",), float, 30.0,
     "seconds in-flight requests get to finish after SIGTERM"),
    ("--cuda-graphs", ("CUDA_GRAPHS",), str, None,
     "comma-separated decode batch sizes to capture as CUDA graphs (CPU: to compile); 0 = none "
     "(default: the backend's buckets)"),
    ("--served-model-name", ("SERVED_MODEL_NAME",), str, None,
     "name reported in /info and /v1/models (default: the model id)"),
    ("--chat-template", ("CHAT_TEMPLATE",), str, None,
     "Jinja chat template file for chat routes, replacing the tokenizer's (default: the tokenizer's; a base "
     "model has none)"),
    ("--cpu-isa", ("CPU_ISA",), str, "auto",
     "instruction-set level the CPU kernels are built for and run at: portable, avx2, avx512, avx512-vnni or amx, "
     "up to what this CPU runs (default auto: the best it runs); a lower one serves as a lesser CPU would. "
     "Reported in /info and `switchyard backends`"),
    ("--quantized-activations", ("QUANTIZED_ACTIVATIONS",), str, "auto",
     "how activations meet block-quantized (GGUF) weights on the CPU: int8x2 (int8 per 32 values, then what that "
     "lost, ~15 bits: closest to the float reference), int8 (llama.cpp's one pass: half the integer work) or auto "
     "(int8x2 for models under 0.5B weights, int8 above; reported in /info)"),
    ("--seed", ("SEED",), int, None,
     "seed of the noise that requests without a seed of their own share (vLLM's --seed): a server started with it "
     "samples the same requests, batched alike, to the same tokens (default: a random seed at each start)"),
    ("--grammar-backend", ("GRAMMAR_BACKEND",), str, "xgrammar",
     "compiler of response_format / grammar / tool-call grammars: xgrammar or outlines"),
    ("--grammar-max-spec-bytes", ("GRAMMAR_MAX_SPEC_BYTES",), int, GrammarConfig.max_spec_bytes,
     "largest JSON schema / regex text"),
    ("--grammar-max-compiled-bytes", ("GRAMMAR_MAX_COMPILED_BYTES",), int, GrammarConfig.max_grammar_bytes,
     "largest compiled grammar"),
    ("--grammar-cache-bytes", ("GRAMMAR_CACHE_BYTES",), int, GrammarConfig.cache_bytes,
     "bytes of compiled grammars kept"),
    ("--grammar-compile-timeout", ("GRAMMAR_COMPILE_TIMEOUT",), float, GrammarConfig.compile_timeout_s,
     "seconds one grammar may compile; a slower one is killed and its request fails (a 503 if the busy "
     "server starved it of CPU)"),
    ("--grammar-workers", ("GRAMMAR_WORKERS",), int, None,
     "low-priority grammar compile processes for grammars of any size (default: 2, or 1 on a single CPU); "
     "one more, started ahead, takes only small and medium ones (up to 64 KiB), so they never wait behind "
     "heavy compiles"),
]
GRAMMAR_BACKENDS = ("xgrammar", "outlines")
QUANTIZED_ACTIVATIONS = ("auto", "int8x2", "int8")  # EngineConfig.quantized_activations
_SERVE_SWITCHES = [
    ("--json-output", ("JSON_OUTPUT",), "structured JSON logs"),
    ("--disable-grammar-support", ("DISABLE_GRAMMAR_SUPPORT",),
     "refuse what needs a grammar: grammar, response_format, guided_*, tool_choice required or named"),
    ("--trust-remote-code", ("TRUST_REMOTE_CODE",), "run a checkpoint's own modeling code (config.auto_map)"),
    ("--sharded", ("SHARDED",), "shard the model (TGI's flag); needs --num-shard N > 1"),
    ("--enforce-eager", ("ENFORCE_EAGER",),
     "run every step through the Python model: no CUDA graphs, no CPU decode steps in C++ or compiled (vLLM's flag)"),
    ("--disable-prefix-caching", ("DISABLE_PREFIX_CACHING",),
     "do not keep or reuse the KV blocks of earlier prompts (the n sequences of one prompt still share it)"),
]


def add_serve_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    for flag, envs, kind, default, help_text in _SERVE_FLAGS:
        parser.add_argument(flag, type=kind, default=_env_default(environ, envs, default, kind),
                            help=f"{help_text} [env: {envs[0]}]")
    parser.add_argument("--cors-allow-origin", action="append",
                        default=[o for o in environ.get("CORS_ALLOW_ORIGIN", "").split(",") if o],
                        help="allowed CORS origin (repeatable) [env: CORS_ALLOW_ORIGIN]")
    for flag, envs, help_text in _SERVE_SWITCHES:
        parser.add_argument(flag, action="store_true", default=_env_default(environ, envs, False, bool),
                            help=f"{help_text} [env: {envs[0]}]")
    parser.add_argument("--runtime", choices=("tuned", "plain"), default="tuned",
                        help="tuned: the engine process starts with what its backend asks for (CPU: tcmalloc or "
                        "jemalloc and Intel OpenMP preloaded, one thread per core, bound; your own LD_PRELOAD and "
                        "OMP/KMP variables are kept); plain: as launched. `switchyard backends` shows the choice")
    from .models_registry import add_model_flags
    from .replicas import add_replica_flags

    add_replica_flags(parser, environ)
    add_model_flags(parser, environ)
    from .grpc.flags import add_grpc_flags

    add_grpc_flags(parser, environ)
    from .speculate_flags import add_speculate_flags

    add_speculate_flags(parser, environ)
    from .task_flags import add_task_flags

    add_task_flags(parser, environ)
    from .media.flags import add_media_flags

    add_media_flags(parser, environ)
    from .tracing import add_tracing_flags

    add_tracing_flags(parser, environ)
    from .ray_flags import add_ray_flags

    add_ray_flags(parser, environ)
    from .reasoning.flags import add_reasoning_flags

    add_reasoning_flags(parser, environ)
    from .tool_parsers.flags import add_tool_parser_flags

    add_tool_parser_flags(parser, environ)
    from .lora.flags import add_lora_flags

    add_lora_flags(parser, environ)


def _check_supported(args: argparse.Namespace) -> None:
    from switchyard.core.params import ValidationError

    if args.num_shard < 1:
        raise ValidationError(f"--num-shard must be at least 1, got {args.num_shard}")
    if args.sharded and args.num_shard == 1:
        raise ValidationError("--sharded needs --num-shard N > 1 (the shard count is always explicit)")
    if (args.max_batch_total_tokens is not None and args.max_total_tokens is not None
            and args.max_batch_total_tokens < args.max_total_tokens):  # TGI's launcher refuses it too
        raise ValidationError(f"--max-batch-total-tokens ({args.max_batch_total_tokens}) must be at least "
                              f"--max-total-tokens ({args.max_total_tokens}): one request of that length "
                              "would not fit in the KV cache and would be cut")
    if args.grammar_workers is not None and args.grammar_workers < 1:
        raise ValidationError(f"--grammar-workers must be at least 1, got {args.grammar_workers}")
    if args.quantized_activations not in QUANTIZED_ACTIVATIONS:
        raise ValidationError(f"--quantized-activations must be one of {', '.join(QUANTIZED_ACTIVATIONS)}; "
                              f"got {args.quantized_activations!r}")
    if args.grammar_backend not in GRAMMAR_BACKENDS:
        raise ValidationError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}; "
                              f"got {args.grammar_backend!r}")


def engine_config(args: argparse.Namespace):
    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

    _check_supported(args)
    block_size = 16
    num_blocks = args.num_kv_blocks
    if num_blocks is None and args.max_batch_total_tokens is not None:
        num_blocks = _num_blocks_within(args.max_batch_total_tokens, block_size)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_fraction=args.cuda_memory_fraction,
                        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                        enable_prefix_caching=not args.disable_prefix_caching)
    return EngineConfig(
        # vLLM's --enforce-eager: no prepared decode steps of any kind (CUDA graphs, CPU C++ layers or graphs)
        graph_batch_sizes=() if args.enforce_eager else _graph_sizes(args.cuda_graphs),
        compile_decode=not args.enforce_eager,  # otherwise a server compiles its decode steps at warm-up
        model=ModelConfig(model=args.model, dtype=args.dtype, quantize=args.quantize, load_format=args.load_format,
                          revision=args.revision, mmproj=args.mmproj,
                          max_model_len=args.max_model_len or args.max_total_tokens,
                          chat_template=args.chat_template, model_impl=args.model_impl,
                          trust_remote_code=args.trust_remote_code, **_task_options(args)),
        cache=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batch_prefill_tokens,
                                  max_num_seqs=args.max_batch_size, waiting_served_ratio=args.waiting_served_ratio,
                                  max_waiting_tokens=args.max_waiting_tokens),
        grammar=GrammarConfig(backend=args.grammar_backend, max_spec_bytes=args.grammar_max_spec_bytes,
                              max_grammar_bytes=args.grammar_max_compiled_bytes, cache_bytes=args.grammar_cache_bytes,
                              compile_timeout_s=args.grammar_compile_timeout,
                              num_compile_workers=args.grammar_workers),
        parallel=ParallelConfig(tensor_parallel_size=args.num_shard, nnodes=args.nnodes, node_rank=args.node_rank,
                                master_addr=args.master_addr, master_port=args.master_port,
                                **_ray_parallel_options(args)),
        backend=args.backend, runtime=args.runtime, tracing=_tracing_config(args), isa=args.cpu_isa,
        quantized_activations=args.quantized_activations, sampling_seed=args.seed,
        speculative=_speculative_config(args), lora=_lora_config(args))


def _lora_config(args: argparse.Namespace):
    from .lora.flags import lora_config

    return lora_config(args)


def _tracing_config(args: argparse.Namespace):
    from .tracing import tracing_config

    return tracing_config(args)


def _ray_parallel_options(args: argparse.Namespace) -> dict:
    from .ray_flags import ray_parallel_options

    return ray_parallel_options(args)


def _task_options(args: argparse.Namespace) -> dict:
    from .task_flags import task_options

    return task_options(args)


def _speculative_config(args: argparse.Namespace):
    from .speculate_flags import speculative_config

    return speculative_config(args)


def _num_blocks_within(max_batch_total_tokens: int, block_size: int) -> int:
    """KV blocks for --max-batch-total-tokens: whole blocks, rounded down so the cache never
    holds more tokens than asked (as TGI's block allocator does), plus the reserved block 0."""
    from switchyard.core.params import ValidationError

    if max_batch_total_tokens < block_size:
        raise ValidationError(f"--max-batch-total-tokens must be at least the block size ({block_size}), "
                              f"got {max_batch_total_tokens}")
    return max_batch_total_tokens // block_size + 1


def _graph_sizes(flag: str | None) -> tuple[int, ...] | None:
    """TGI's --cuda-graphs: "1,2,4,8" or "0" (off)."""
    from switchyard.core.params import ValidationError

    if flag is None:
        return None
    try:
        sizes = tuple(int(part) for part in flag.split(",") if part.strip())
    except ValueError:
        raise ValidationError(f"--cuda-graphs takes comma-separated batch sizes, not {flag!r}") from None
    return tuple(s for s in sizes if s > 0)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    model_id = args.served_model_name or _display_name(args.model)
    return ServerSettings(
        model_id=model_id, hostname=args.hostname, port=args.port,
        max_concurrent_requests=args.max_concurrent_requests, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens, max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences, max_top_n_tokens=args.max_top_n_tokens,
        max_client_batch_size=args.max_client_batch_size, api_key=args.api_key,
        cors_allow_origin=tuple(args.cors_allow_origin), payload_limit=args.payload_limit,
        json_output=args.json_output, disable_grammar_support=args.disable_grammar_support,
        graceful_shutdown_s=args.graceful_shutdown_timeout, grpc_port=args.grpc_port, version=_version(),
        tracing=_tracing_config(args), reasoning_parser=_reasoning_parser(args),
        tool_call_parser=_tool_call_parser(args), lora=_lora_settings(args),
        media=_media_policy(args))


def _media_policy(args: argparse.Namespace):
    from .media.flags import media_policy

    return media_policy(args)


def _lora_settings(args: argparse.Namespace):
    from .lora.adapters import LoraSettings
    from .lora.flags import allowed_dirs

    config = _lora_config(args)
    return LoraSettings(config.enabled, config.adapters, allowed_dirs(args))


def _reasoning_parser(args: argparse.Namespace) -> str:
    from .reasoning.flags import reasoning_parser

    return reasoning_parser(args)


def _tool_call_parser(args: argparse.Namespace) -> str:
    from .tool_parsers.flags import tool_call_parser

    return tool_call_parser(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard")
    except PackageNotFoundError:
        return "0.0.0"


def _display_name(model: str | None) -> str:
    if model is None:
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
    return model.rstrip("/")


def run_server(args: argparse.Namespace) -> int:
    """Listens at once (503 while the engine loads) and serves until SIGTERM / SIGINT or the
    engine fails: 0 after a signal, 1 after an engine or shard death or a failed load. A model
    the engine refuses before loading it (unknown, unsupported) is raised: a one-line user
    error (cli.py, exit status 2)."""
    from .app import create_app
    from .logs import configure_logging, uvicorn_log_config

    configure_logging(args.json_output)
    config = engine_config(args)
    if config.parallel.node_rank > 0:
        return _run_shard_node(config)
    settings = server_settings(args)
    # the port accepts from here on (a connection waits in its backlog the second until the app
    # answers it), and one already taken is said before any engine starts
    sock = listening_socket(settings.hostname, settings.port)
    from .grpc.flags import check_grpc

    check_grpc(settings.hostname, settings.grpc_port)
    from .models_registry import install_models, model_specs

    specs = model_specs(args, config, settings.model_id)  # several with --models or --model-id repeated
    config, settings = specs[0].config, dataclasses.replace(settings, model_id=specs[0].name)
    client = make_engine_client(config, args.json_output, specs[0].replicas, args.data_parallel_routing)
    client.start()
    registry = None
    try:
        threading.Thread(target=_log_model, args=(client,), name="switchyard-model-check", daemon=True).start()
        threading.Thread(target=_preload_tokenizer_code, name="switchyard-tokenizer-import", daemon=True).start()
        app = create_app(settings, client)  # imports the routes: most of the gateway's start-up
        if specs[0].replicas > 1:
            client.export_metrics(app.state.metrics)  # per-replica series (gateway/replicas.py)
        registry = install_models(app, specs, args, lambda spec: make_engine_client(
            spec.config, args.json_output, spec.replicas, args.data_parallel_routing))
        server_config = uvicorn.Config(app, host=settings.hostname, port=settings.port,
                                       log_config=uvicorn_log_config(args.json_output),
                                       timeout_graceful_shutdown=settings.graceful_shutdown_s, timeout_keep_alive=5)
        DrainingServer(server_config, app.state.drain, engine=client).run(sockets=[sock])
    finally:
        sock.close()
        if registry is not None:
            asyncio.run(registry.shutdown())  # the models loaded on demand
        asyncio.run(client.shutdown())  # the engine process and its workers end with us
    return _exit_status(client)


_BACKLOG = 2048  # uvicorn's default


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (uvicorn then serves it, as its own
    Config.bind_socket would have made it); a port that cannot be had is a user error."""
    from switchyard.core.params import ValidationError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ValidationError(f"cannot listen on {host}:{port} (--hostname, --port): {exc.strerror or exc}") from None
    where = f"[{host}]" if ":" in host else host
    logger.info("listening on http://%s:%d (503 until the model is loaded)", where, sock.getsockname()[1])
    return sock


def _log_model(client) -> None:
    """Logs what the engine process found (the model check comes seconds after the port opens)."""
    try:
        logger.info("model %s", client.wait_model_checked())
    except BaseException:  # noqa: BLE001 - the failure is the server's exit status (_exit_status)
        pass


def _preload_tokenizer_code() -> None:
    """Imports the tokenizer's and the chat template's code (`tokenizers`, jinja2; no
    transformers, no torch) while the engine loads: the engine hands its tokenizer over pickled
    when ready (core/text/serving_tokenizer.py), and the first chat request compiles a template."""
    try:
        import jinja2.sandbox  # noqa: F401 - the import is the point
        import tokenizers  # noqa: F401
    except Exception:  # noqa: BLE001 - the unpickling imports what it needs, and reports its own errors
        pass


def _exit_status(client) -> int:
    if client.failure is None:
        return 0
    if client.model_description is None and client.startup_error is not None:
        raise client.startup_error  # refused before loading: the user's to fix
    logger.error("exiting: %s", client.failure)
    return 1


def _run_shard_node(config) -> int:
    """A node k > 0 of a multi-node run: its shards only (no HTTP, no scheduler)."""
    from switchyard.core.plugins import select_backend
    from switchyard.core.engine.shard_worker import run_node

    return run_node(config, select_backend(config.backend))


class DrainingServer(uvicorn.Server):
    """uvicorn's server that also starts the app's stream drain (gateway/drain.py) when
    SIGTERM or SIGINT arrives, so open streams end properly before uvicorn's deadline; and,
    given its `engine` (an EngineClient), stops the same way once the engine fails. That stop
    is no signal: uvicorn re-raises a signal it caught once drained, which would end the
    process by SIGTERM (status -15) where an engine death must exit non-zero (status 1, so a
    supervisor's Restart=on-failure restarts it)."""

    def __init__(self, config: uvicorn.Config, drain, engine=None):
        super().__init__(config)
        self._drain = drain
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        self._drain.begin()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: also stop once the engine has failed (its streams already have their error)."""
        if self._engine is not None and self._engine.failure is not None and not self.should_exit:
            logger.info("stopping the server: the engine is not serving (see above)")
            self._drain.begin()
            self.should_exit = True
        return await super().on_tick(counter)


def make_engine_client(config, json_output: bool = False, data_parallel_size: int = 1,
                       data_parallel_routing: str = "cache-aware"):
    """The engine in its own process (core/engine/process.py): this process never imports
    torch, and a crash there is reported here instead of taking the server down silently.
    With --data-parallel-size N > 1, N of them behind one ReplicaSetClient (gateway/replicas.py)."""
    from functools import partial

    from switchyard.core.engine.process import ProcessEngineClient

    from .logs import configure_logging

    def make(engine_config):
        return ProcessEngineClient(engine_config, log_setup=partial(configure_logging, json_output))

    if data_parallel_size == 1:
        return make(config)
    from .replicas import replica_set

    return replica_set(config, data_parallel_size, data_parallel_routing, make)


def environ() -> Mapping[str, str]:
    """The process environment, read when the command line is parsed."""
    return os.environ
