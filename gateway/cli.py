"""`switchyard` command line: flags become an EngineConfig; nothing reads the
environment at import time."""
from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.HelpFormatter):
    """`--help` that shows every flag's default: "(default: X)" before the flag's "[env: NAME]",
    unless its help states the default itself (as it must where the default is None, whose
    meaning is the flag's to say); a switch's default reads on or off, a list's its items."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is argparse.SUPPRESS or "default:" in text:
            return text
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, list):
            shown = ", ".join(str(item) for item in default) or "none"
        else:
            shown = "%(default)s"
        head, env, tail = text.rpartition(" [env: ")
        return f"{head} (default: {shown}){env}{tail}" if env else f"{text} (default: {shown})"


def _add_engine_flags(parser: argparse.ArgumentParser, environ=None) -> None:
    environ = environ or {}
    from .models_registry import ModelIds

    parser.add_argument("--model-id", "--model", dest="model", default=environ.get("MODEL_ID") or None,
                        action=ModelIds,
                        help="local HF model directory, .gguf file or HF cache name (default: SmolLM2-135M-Instruct);"
                        " `serve` takes it again for more models, the first the default [env: MODEL_ID]")
    parser.add_argument("--backend", default=environ.get("SWITCHYARD_BACKEND") or None,
                        help="backend plugin name (default: the usable one of highest priority; `switchyard "
                        "backends` lists them) [env: SWITCHYARD_BACKEND]")
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
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                        help="how the weights are read: auto (from the model's files), safetensors, gguf, or dummy "
                        "(random weights of the model's config, for benchmarks)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the context served, prompt and output (default: the model's context length; "
                        "serve: --max-total-tokens where given)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV capacity in blocks of 16 tokens (default: sized at start)")
    parser.add_argument("--kv-cache-memory", type=_memory_size, default=environ.get("KV_CACHE_MEMORY") or None,
                        metavar="SIZE",
                        help="CPU: the KV cache's size when no token count is given, like vLLM-CPU's KV cache space: "
                        "what the most requests at once (--max-batch-size) of the whole context can hold, up to "
                        "SIZE bytes (4GiB, 512MB; default: up to 16,384 tokens, or one request of the whole context where that "
                        "is more) [env: KV_CACHE_MEMORY]")
    from switchyard.core.config import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", default=environ.get("KV_CACHE_DTYPE") or "auto", choices=KV_CACHE_DTYPES,
                        help="what the KV cache stores, TGI's flag: auto (the model's dtype), or one byte a value with a "
                        "float32 scale per token and KV head: int8 (as llama.cpp's -ctk/-ctv q8_0), fp8_e4m3fn, "
                        "fp8_e5m2 (about 3.8x the tokens of float32 in the same memory); a backend that does not "
                        "read it refuses to start [env: KV_CACHE_DTYPE]")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="model code: native, the transformers fallback, or auto (native where it exists)")


def _memory_size(text: str | None) -> int | None:
    """--kv-cache-memory's bytes (core/kv/sizing.py parses them); None when not given."""
    from switchyard.core.kv.sizing import parse_memory_size

    if text in (None, ""):
        return None
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
            integer = f"; float32 for {', '.join(caps.integer_quantizations)} (integer products)" \
                if caps.integer_quantizations else ""
            print(f"{'':<9}dtype auto = {caps.preferred_dtype} (of {', '.join(caps.dtypes)}){integer}")
            if caps.kv_cache_dtypes:
                print(f"{'':<9}KV cache (--kv-cache-dtype): auto, {', '.join(caps.kv_cache_dtypes)}")
            if caps.isa_levels:
                print(f"{'':<9}instruction sets (--cpu-isa): {', '.join(level for level, _ in caps.isa_levels)} "
                      f"(auto: {caps.isa_levels[-1][0]})")
            if caps.runtime:
                print(f"{'':<9}runtime (serve --runtime tuned): {caps.runtime}")
    from switchyard.core.quant.methods import table

    print("quantization methods (--quantize NAME; a checkpoint's own is detected from its quantization_config):")
    print("\n".join(f"  {line}" for line in table().splitlines()))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    """Each prompt in turn, its text printed as it is decoded: through the model's chat template
    when it has one (or with --chat, which insists), as a plain completion with --raw."""
    from switchyard.core import LLM, SamplingParams

    from .logs import configure_logging

    configure_logging(json_output=False)  # loading and a first start's kernel builds take a while: say so
    llm = LLM(model=args.model, backend=args.backend, dtype=args.dtype, quantize=args.quantize,
              load_format=args.load_format,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype, model_impl=args.model_impl,
              trust_remote_code=args.trust_remote_code, tensor_parallel_size=args.num_shard,
              task="generate")  # an embedding model is refused in one line
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop or ()),
                                ignore_eos=args.ignore_eos)
        chat = _generate_chat(args, llm.tokenizer)
        for prompt in args.prompts:
            if chat:
                llm.chat([{"role": "user", "content": prompt}], params, on_text=_print_text)
            else:
                llm.generate(prompt, params, on_text=_print_text)
            print(flush=True)
    finally:
        llm.shutdown()
    return 0


def _generate_chat(args: argparse.Namespace, tokenizer) -> bool:
    """Whether `generate` renders its prompts with the chat template (ChatTemplateError when
    --chat insists on a template the model lacks)."""
    from switchyard.core.text.chat_template import ChatTemplateError, has_chat_template

    if args.raw:
        return False
    if args.chat and not has_chat_template(tokenizer):
        raise ChatTemplateError("--chat: this model has no chat template (drop --chat for a plain completion)")
    return has_chat_template(tokenizer)


def _print_text(prompt_index: int, sample_index: int, text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


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
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM serving engine",
                                     formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list discovered backends, whether usable and why",
                                   formatter_class=HelpFormatter)
    backends.set_defaults(run=_cmd_backends)
    generate = commands.add_parser("generate", help="generate text offline", formatter_class=HelpFormatter)
    generate.add_argument("prompts", nargs="+", help="each prompt is generated from in turn")
    template = generate.add_mutually_exclusive_group()
    template.add_argument("--chat", action="store_true",
                          help="render the prompt with the model's chat template, an error if it has none "
                          "(the default uses it when the model has one)")
    template.add_argument("--raw", action="store_true",
                          help="a plain completion of the prompt text, without the chat template")
    generate.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                          "whose probabilities add up to this")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, not reproducible)")
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    generate.add_argument("--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code")
    generate.add_argument("--num-shard", type=int, default=1, help="shards (tensor parallelism) on this machine")
    _add_engine_flags(generate, environ)
    generate.set_defaults(run=_cmd_generate)
    models = commands.add_parser("models", help="supported architectures; with --model-id, which path it takes",
                                 formatter_class=HelpFormatter)
    models.add_argument("--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code")
    _add_engine_flags(models, environ)
    models.set_defaults(run=_cmd_models)
    serve = commands.add_parser("serve", help="serve the OpenAI and TGI HTTP APIs", formatter_class=HelpFormatter)
    _add_engine_flags(serve, environ)
    add_serve_flags(serve, environ)
    serve.set_defaults(run=_cmd_serve)
    from .bench.command import add_bench_command
    from .download import add_download_command

    add_bench_command(commands)
    add_download_command(commands, HelpFormatter)
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
