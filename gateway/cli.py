"""`switchyard` command line: flags become an EngineConfig; nothing reads the
environment at import time."""
from __future__ import annotations

import argparse
import sys


def _add_engine_flags(parser: argparse.ArgumentParser, environ=None) -> None:
    environ = environ or {}
    parser.add_argument("--model-id", "--model", dest="model", default=environ.get("MODEL_ID") or None,
                        help="local HF model directory, .gguf file or HF cache name (default: SmolLM2-135M-Instruct)"
                        " [env: MODEL_ID]")
    parser.add_argument("--backend", default=environ.get("SWITCHYARD_BACKEND") or None,
                        help="backend plugin name (default: best usable)")
    parser.add_argument("--dtype", default=environ.get("DTYPE") or "auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: the backend's choice (CPU: bfloat16 where the CPU has AVX512-BF16 or AMX, "
                        "else float32) [env: DTYPE]")
    parser.add_argument("--quantize", default=environ.get("QUANTIZE") or None,
                        help="weight quantization, TGI's flag (default: a GGUF file's own blocks, a Hub "
                        "checkpoint's quantization_config, else none): gguf, int8, int4, gptq, awq, marlin, "
                        "compressed-tensors, eetq, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, fp8, or "
                        "none (a GGUF dequantized into --dtype); `switchyard backends` lists what each backend "
                        "serves, and a value it does not is refused [env: QUANTIZE]")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV capacity in blocks (default: sized at warm-up)")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="model code: native, the transformers fallback, or auto (native where it exists)")


def _cmd_backends(args: argparse.Namespace) -> int:
    from switchyard.core.plugins import discover_backends

    for report in discover_backends():
        state = "usable" if report.usable else "not usable"
        line = f"{report.name:<8} priority={report.priority:<4} {state}: {report.reason}"
        if report.attention_impl:  # what it runs, or would run where usable
            line += f" [{'attention' if report.usable else 'would use'}: {report.attention_impl}]"
        print(line)
        if report.capabilities is not None:
            caps = report.capabilities
            print(f"{'':<9}dtype auto = {caps.preferred_dtype} (of {', '.join(caps.dtypes)})")
            if caps.runtime:
                print(f"{'':<9}runtime (serve --runtime tuned): {caps.runtime}")
    from switchyard.core.quant.methods import table

    print("quantization methods (--quantize NAME; a checkpoint's own is detected from its quantization_config):")
    print("\n".join(f"  {line}" for line in table().splitlines()))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from switchyard.core import LLM, SamplingParams

    llm = LLM(model=args.model, backend=args.backend, dtype=args.dtype, quantize=args.quantize,
              load_format=args.load_format,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, model_impl=args.model_impl,
              trust_remote_code=args.trust_remote_code, tensor_parallel_size=args.num_shard)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop or ()),
                            ignore_eos=args.ignore_eos)
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        results = llm.generate(list(args.prompts), params)
    llm.shutdown()
    for result in results:
        print(result.text)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from switchyard.core.loader import model_path_report

    print(model_path_report(args.model, args.model_impl, args.trust_remote_code, args.load_format))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serve import run_server

    return run_server(args)


def build_parser(environ=None) -> argparse.ArgumentParser:
    """`environ` (default: the process environment, read now) gives TGI's variables
    as flag defaults."""
    from .serve import add_serve_flags, environ as process_environ

    environ = process_environ() if environ is None else environ
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list discovered backends, whether usable and why")
    backends.set_defaults(run=_cmd_backends)
    generate = commands.add_parser("generate", help="generate text offline")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code")
    generate.add_argument("--num-shard", type=int, default=1, help="shards (tensor parallelism) on this machine")
    _add_engine_flags(generate, environ)
    generate.set_defaults(run=_cmd_generate)
    models = commands.add_parser("models", help="supported architectures; with --model-id, which path it takes")
    models.add_argument("--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code")
    _add_engine_flags(models, environ)
    models.set_defaults(run=_cmd_models)
    serve = commands.add_parser("serve", help="serve the OpenAI and TGI HTTP APIs")
    _add_engine_flags(serve, environ)
    add_serve_flags(serve, environ)
    serve.set_defaults(run=_cmd_serve)
    from .bench.command import add_bench_command

    add_bench_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:  # noqa: BLE001 - user errors are printed, not dumped as tracebacks
        from switchyard.core.loader.source import ModelNotFoundError
        from switchyard.core.models import UnsupportedModelError
        from switchyard.core.params import ValidationError
        from switchyard.core.plugins import BackendError

        if isinstance(exc, (ValidationError, BackendError, ModelNotFoundError, UnsupportedModelError)):
            print(f"switchyard: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
