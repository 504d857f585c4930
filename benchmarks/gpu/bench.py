"""The CUDA backend's GPU benchmark, one run (see run_h200.sh):

  1. Triton kernels vs the plain-torch references at Llama-3-8B shapes, bf16.
  2. Batch-1 decode ms/token on random-weight Llama-3-8B (bf16, CUDA graphs) next to the
     roofline: weight bytes read per step / measured device-to-device copy bandwidth.
  3. Output tokens/s for N requests (prompts 64-512 tokens, 256 new tokens, EOS ignored)
     through our engine, next to transformers' continuous batching (`generate_batch`)
     on the same weights and requests (a subset when the whole would not fit the budget).
  4. The same shape quantized (quant_bench.py): GPTQ 4-bit and AWQ checkpoints of random
     weights written here offline, and fp8 made at load; per row the kernels chosen, load
     time, batch-1 decode next to its roofline and output tokens/s.
  5. Images in (run before 4, seconds): a tiny random-weight vision-language model's greedy
     tokens for two image prompts through the CUDA backend, the tower on the GPU, equal to the
     CPU reference backend's (core/testing/backend_contract.py image_answers).

    python benchmarks/gpu/bench.py --out DIR            # on the GPU machine
    python benchmarks/gpu/bench.py --smoke --out DIR    # CPU, llama-tiny, interpreter: checks the script

Each section has a time budget and its own try/except; the whole run aims at < 10 minutes
(sections 1-3 about 6, section 4 --quant-budget seconds).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # triton reads it when the kernels are defined: before anything imports them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import quant_bench  # noqa: E402
from common import Deadline, Log, random_prompts, run_section  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU stand-in run of every section at toy sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of bench.log")
    parser.add_argument("--model", default=None, help="named dummy shape (default llama-3-8b; smoke: llama-tiny)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--total-budget", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--quant-methods", default=",".join(quant_bench.METHODS),
                        help="section 4's rows, comma-separated (gptq, awq, fp8; 'none': no section 4)")
    parser.add_argument("--quant-budget", type=float, default=220.0, help="seconds kept for section 4")
    args = parser.parse_args()
    args.quant_methods = [m for m in args.quant_methods.split(",") if m and m != "none"]
    unknown = sorted(set(args.quant_methods) - set(quant_bench.METHODS))
    if unknown:
        parser.error(f"--quant-methods: unknown {', '.join(unknown)} (known: {', '.join(quant_bench.METHODS)})")
    if not args.quant_methods:
        args.quant_budget = 0.0
    big = not args.smoke
    args.model = args.model or ("llama-3-8b" if big else "llama-tiny")
    args.dtype = "bfloat16" if big else "float32"
    args.requests = args.requests or (512 if big else 12)
    args.new_tokens = args.new_tokens or (256 if big else 6)
    args.prompt_min, args.prompt_max = (64, 512) if big else (3, 24)
    args.max_num_seqs = 256 if big else 8
    args.max_batched_tokens = 8192 if big else 128
    args.max_model_len = None if big else 64
    args.decode_prompt_len, args.decode_tokens = (128, 128) if big else (8, 6)
    args.copy_bytes, args.copy_iterations = (4 * 2**30, 20) if big else (2**24, 5)
    args.warm_requests = 16 if big else 3
    args.hf_first_subset = 64 if big else 4
    args.quant_group = 128 if big else 32  # llama-tiny's layers are 64 and 128 wide
    args.quant_max_num_seqs = 64 if big else 8
    args.quant_requests, args.quant_new_tokens = (128, 128) if big else (6, 4)
    args.quant_row_min_s = 60.0 if big else 5.0  # what a row needs at least (checkpoint, load, warm-up, decode)
    args.scratch = os.environ.get("TMPDIR") or "/tmp"  # the random checkpoints are written (and removed) here
    return args


def main() -> int:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "bench.log"))
    hard_end = time.perf_counter() + args.total_budget
    device = torch.device("cpu" if args.smoke else "cuda")
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
        f"smoke={args.smoke}, model {args.model} {args.dtype}, budget {args.total_budget:.0f}s")
    import kernels_check

    run_section(log, "1. Triton kernels vs references", kernels_check.run, log, device, args.smoke)
    from common import make_backend
    import engine_bench

    args.copy_bandwidth = run_section(log, "device-to-device copy bandwidth", measure_bandwidth, log, device, args)

    engine = run_section(log, "engine warm-up (dummy weights, profiling, KV sizing, graph capture)",
                         engine_bench.build_engine, log, make_backend(args.smoke), args.model, args.dtype,
                         args.max_num_seqs, args.max_batched_tokens, args.max_model_len)
    status = 0 if engine is not None else 1
    if engine is not None:
        bf16_end = hard_end - args.quant_budget  # what sections 2 and 3 may take
        run_section(log, "2. batch-1 decode vs roofline", engine_bench.decode_latency, log, engine, device, args)
        prompts = random_prompts(args.requests, args.prompt_min, args.prompt_max, engine.loaded.vocab_size, seed=0)
        ours = run_section(log, "3a. throughput: switchyard", engine_bench.throughput, log, engine, prompts,
                           args.new_tokens, Deadline.after(150, bf16_end - 120), args)
        if not args.skip_transformers:
            theirs = run_section(log, "3b. throughput: transformers generate_batch", baseline, log, engine, prompts,
                                 args, device, bf16_end)
            compare(log, ours, theirs)
        quant_bench.release(engine, device)  # sections 2-3's weights, KV cache and graphs leave the device
        engine = None
        quant_bench.free_device_memory(device)
    if not run_section(log, "5. images in: a tiny vision-language model's greedy tokens, CUDA against the reference",
                       check_images, log, make_backend(args.smoke)):
        status = 1
    if args.quant_methods:
        run_section(log, f"4. quantized {args.model}: {', '.join(args.quant_methods)}", quant_bench.run, log, args,
                    device, lambda: make_backend(args.smoke), Deadline(hard_end - 5))
    return status


def check_images(log, backend) -> bool:
    """The vision tower on the device (Capabilities.vision_encoders): the contract suite's image
    prompts, float32, equal to the CPU reference backend's tokens."""
    from switchyard.core.testing.backend_contract import image_answers

    answers, expected = image_answers(backend, 16)
    log(f"  CUDA {answers}\n  reference {expected}\n  {'equal' if answers == expected else 'DIFFERENT'}")
    return answers == expected


def measure_bandwidth(log, device, args) -> float:
    """Before the KV cache takes the memory: a copy between two large buffers."""
    import engine_bench

    bandwidth = engine_bench.copy_bandwidth(device, args.copy_bytes, args.copy_iterations)
    log(f"{bandwidth / 1e12:.3f} TB/s counting bytes read + bytes written ({args.copy_bytes / 2**30:.1f} GiB "
        f"copied {args.copy_iterations} times after one untimed copy)")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return bandwidth


def baseline(log, engine, prompts, args, device, hard_end):
    import hf_baseline

    start = time.perf_counter()
    free_engine_cache(engine, device)
    model = hf_baseline.hf_model_from(engine.loaded, device, "sdpa")
    engine.loaded.model.to("meta")  # our weights leave the device too
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"transformers LlamaForCausalLM built with our weights in {time.perf_counter() - start:.1f}s; "
        f"attention: continuous batching switches it to paged|sdpa (flash-attn is not installed)")
    return hf_baseline.run(log, model, prompts, args.new_tokens, Deadline(hard_end - 5), args.hf_first_subset)


def free_engine_cache(engine, device) -> None:
    """Our KV cache and graphs leave the device before transformers' model and cache arrive."""
    engine.runner.kv_caches.clear()
    engine.runner.graphs.clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def compare(log, ours, theirs) -> None:
    log.section("summary")
    if not ours or not theirs:
        log("no throughput comparison: a run is missing (see above)")
        return
    largest = max(theirs)
    import engine_bench

    shared = engine_bench.agreement(ours["token_ids"][:8], theirs[largest]["token_ids"])
    log(f"same weights check: leading greedy tokens shared with transformers, first 8 requests: {shared} of "
        f"{len(ours['token_ids'][0])} (they part where bf16 rounding flips near-tied random-weight logits)")
    ratio = ours["tokens_per_s"] / theirs[largest]["tokens_per_s"]
    log(f"RESULT throughput: switchyard {ours['tokens_per_s']:,.0f} tokens/s vs transformers generate_batch "
        f"{theirs[largest]['tokens_per_s']:,.0f} tokens/s ({largest} requests) = {ratio:.1f}x (aim: >= 10x) -> "
        f"{'MET' if ratio >= 10 else 'NOT MET'}")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a transformers run past its budget may still hold a thread on the device
