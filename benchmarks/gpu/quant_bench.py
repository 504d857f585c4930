"""Section 4: the same model shape served quantized, one row per method: GPTQ 4-bit (symmetric,
groups of 128), AWQ 4-bit (GEMM layout, zero points, groups of 128) and fp8 (e4m3, per channel).

Nothing is downloaded. GPTQ and AWQ checkpoints of random weights are written here, offline, in
the layouts their tools write (GPTQ: qweight int32 [in / 8, out] packed along `in`, qzeros with
checkpoint_format "gptq"'s zero points minus one, scales fp16 [groups, out]; AWQ's GEMM layout:
qweight and qzeros int32 [., out / 8] packed along `out`, scales fp16), one safetensors file per
decoder layer, with a config.json whose quantization_config names them: the engine detects the
method from it, core/quant/hub converts each layer, and the CUDA backend's prepare_model packs it
for its kernel (backends/cuda/quant.py: Marlin where vLLM or gptqmodel is installed, else the
Triton dequantize-GEMM). The codes are uniform random 4-bit words (random in any order within a
word, so AutoAWQ's interleaving, which the reader undoes, needs no care here), the scales sized so
the weights have the dummy weights' spread (std ~0.02). The fp8 row is the dummy model quantized
at load (--quantize fp8: per-channel scales, torch._scaled_mm on an fp8 GPU).

Each row: load + pack + warm-up time, the weight bytes on the device, batch-1 decode ms/token next
to its roofline (weight bytes read per step / the copy bandwidth), and output tokens/s on a batch of
requests. A row that would not fit what is left of the section's budget is skipped with a line.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from common import Deadline, drive, random_prompts

METHODS = ("gptq", "fp8", "awq")  # in this order: AWQ is the first to go when the budget runs out
DUMMY_STD = 0.02  # core/loader/dummy.py's weights
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder linear of a Llama config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return {"q_proj": (config.num_attention_heads * head_dim, hidden), "k_proj": (kv, hidden),
            "v_proj": (kv, hidden), "o_proj": (hidden, config.num_attention_heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _words(shape, generator, device) -> torch.Tensor:
    """Random int32 words: eight uniform 4-bit codes each."""
    return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, device=device, dtype=torch.int32)


def _scales(shape, std_codes: float, generator, device) -> torch.Tensor:
    """fp16 scales that give weights of about DUMMY_STD (codes of standard deviation std_codes)."""
    base = DUMMY_STD / std_codes
    return (base * (0.75 + 0.5 * torch.rand(shape, generator=generator, device=device))).half()


def quantized_layer(method: str, out: int, inp: int, group: int, generator, device) -> dict[str, torch.Tensor]:
    groups = inp // group
    if method == "gptq":  # symmetric: zero point 8, stored as 7 in every nibble (checkpoint_format "gptq")
        return {"qweight": _words((inp // 8, out), generator, device),
                "qzeros": torch.full((groups, out // 8), 0x77777777, dtype=torch.int32, device=device),
                "scales": _scales((groups, out), 4.61, generator, device)}
    return {"qweight": _words((inp, out // 8), generator, device),  # awq: random zero points
            "qzeros": _words((groups, out // 8), generator, device),
            "scales": _scales((groups, out), 6.52, generator, device)}


def quantization_config(method: str, group: int) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def write_checkpoint(method: str, shape: str, group: int, path: str, device: torch.device, dtype: torch.dtype) -> int:
    """A random-weight `method` checkpoint of named shape `shape` under `path`; returns its bytes."""
    from safetensors.torch import save_file
    from switchyard.core.loader.named_configs import named_config

    config = named_config(shape)
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = linear_shapes(config)
    written = 0

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        nonlocal written
        host = {k: v.contiguous().cpu() for k, v in tensors.items()}
        save_file(host, os.path.join(path, name), metadata={"format": "pt"})
        written += sum(t.numel() * t.element_size() for t in host.values())

    def floats(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=generator, device=device) * DUMMY_STD).to(dtype)

    ones = lambda n: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    save({"model.embed_tokens.weight": floats(config.vocab_size, config.hidden_size),
          "model.norm.weight": ones(config.hidden_size),
          "lm_head.weight": floats(config.vocab_size, config.hidden_size)}, "model-outer.safetensors")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        tensors = {f"{prefix}.input_layernorm.weight": ones(config.hidden_size),
                   f"{prefix}.post_attention_layernorm.weight": ones(config.hidden_size)}
        for block, names in LINEARS.items():
            for name in names:
                for suffix, tensor in quantized_layer(method, *shapes[name], group, generator, device).items():
                    tensors[f"{prefix}.{block}.{name}.{suffix}"] = tensor
        save(tensors, f"model-{layer:05d}.safetensors")
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        values = json.load(f)
    values["quantization_config"] = quantization_config(method, group)
    values["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(values, f)
    return written


def device_weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes a decode step reads, all weight bytes): parameters, plus the packed buffers of the
    CUDA backend's quantized linears; of the embedding table one row is read."""
    from switchyard.backends.cuda.quant_linear import CudaQuantLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, CudaQuantLinear)
                 for b in m.buffers(recurse=False))
    embedding = model.model.embed_tokens.weight
    read = total - embedding.numel() * embedding.element_size() + embedding.shape[1] * embedding.element_size()
    return read, total


def release(engine, device: torch.device) -> None:
    """The device tensors of `engine` (KV cache, graphs, weights) dropped; the caller drops the
    engine itself, then free_device_memory gives the memory back to the driver."""
    if engine is None:
        return
    engine.runner.kv_caches.clear()
    engine.runner.graphs.clear()
    engine.loaded.model.to("meta")
    free_device_memory(device)


def free_device_memory(device: torch.device) -> None:
    """What no object holds any more goes back to the driver, so that the next engine's memory
    profile (mem_get_info) sees it free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def one_row(log, method: str, args, device: torch.device, make_backend, deadline: Deadline) -> dict:
    import engine_bench

    start = time.perf_counter()
    folder = None
    if method == "fp8":
        model, quantize, load_format, written = args.model, "fp8", "dummy", 0
    else:
        folder = tempfile.mkdtemp(prefix=f"switchyard-{method}-", dir=args.scratch)
        written = write_checkpoint(method, args.model, args.quant_group, folder, device, torch_dtype(args.dtype))
        model, quantize, load_format = folder, None, "auto"
        log(f"{method}: wrote a random {args.model}-shaped checkpoint, {written / 1e9:.2f} GB in "
            f"{time.perf_counter() - start:.1f}s")
    engine = None
    try:
        backend = make_backend()
        built = time.perf_counter()
        engine = engine_bench.build_engine(log, backend, model, args.dtype, args.quant_max_num_seqs,
                                           args.max_batched_tokens, args.max_model_len, quantize=quantize,
                                           load_format=load_format)
        load_s = time.perf_counter() - built
        kinds = dict(backend.quantized)
        read, total = device_weight_bytes(engine.loaded.model)
        log(f"{method}: served as {engine.config.model.quantize}; linears by kernel {kinds}; weights on the device "
            f"{total / 1e9:.2f} GB (a decode step reads {read / 1e9:.2f} GB); load + pack + warm-up {load_s:.1f}s")
        from switchyard.backends.cuda.quant_linear import CudaQuantLinear

        for fmt, kernel in sorted({(m.format, m.kernel) for m in engine.loaded.model.modules()
                                   if isinstance(m, CudaQuantLinear)}):
            log(f"  {fmt} weights: {kernel}")
        vocab = engine.loaded.vocab_size
        prompt = random_prompts(1, args.decode_prompt_len, args.decode_prompt_len, vocab, seed=1)
        drive(engine, prompt, 4, prefix=f"{method}-warm")
        steps = drive(engine, prompt, args.decode_tokens + 1, prefix=f"{method}-decode")["step_times"][1:]
        decode_ms = statistics.median(steps) * 1e3
        roofline_ms = read / args.copy_bandwidth * 1e3 if args.copy_bandwidth else float("nan")
        floor_ms = engine_bench.matmul_floor_ms(engine.loaded.model, device, 20)
        floor = f"; its weight matmuls alone {floor_ms:.3f} ms" if floor_ms is not None else ""
        log(f"{method}: batch-1 decode median {decode_ms:.3f} ms/token, roofline {roofline_ms:.3f} ms "
            f"({decode_ms / roofline_ms:.2f}x){floor}")
        prompts = random_prompts(args.quant_requests, args.prompt_min, args.prompt_max, vocab, seed=0)
        result = drive(engine, prompts, args.quant_new_tokens, deadline, prefix=f"{method}-tput")
        tps = result["output_tokens"] / result["elapsed"]
        note = "" if result["complete"] else \
            f" (stopped at the budget: {result['finished']} of {len(prompts)} finished)"
        log(f"{method}: {len(prompts)} requests x {args.quant_new_tokens} new tokens: {result['output_tokens']} "
            f"tokens in {result['elapsed']:.1f}s = {tps:,.0f} tokens/s{note}")
        return dict(method=method, kinds=kinds, total_gb=total / 1e9, load_s=load_s, decode_ms=decode_ms,
                    roofline_ms=roofline_ms, tokens_per_s=tps, complete=result["complete"])
    finally:
        release(engine, device)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def run(log, args, device: torch.device, make_backend, budget: Deadline) -> list[dict]:
    """Every method of args.quant_methods that fits the budget; a table of the rows at the end."""
    rows = []
    for method in args.quant_methods:
        if budget.left() < args.quant_row_min_s:
            log(f"{method}: skipped, {budget.left():.0f}s of the section's budget left "
                f"(a row needs about {args.quant_row_min_s:.0f}s)")
            continue
        log.section(f"4. {method} {args.model}")
        try:
            rows.append(one_row(log, method, args, device, make_backend, budget))
        except Exception as error:  # noqa: BLE001 - one row's failure must not lose the others
            log.error(f"{method} row", error)
        free_device_memory(device)  # the row's engine is gone now
    log.section("4. quantized rows")
    log(f"{'method':<6} {'kernels':<28} {'GB':>6} {'load s':>7} {'ms/token':>9} {'roofline':>9} {'tokens/s':>9}")
    for row in rows:
        kinds = ",".join(f"{k}:{v}" for k, v in sorted(row["kinds"].items()))
        log(f"{row['method']:<6} {kinds:<28} {row['total_gb']:>6.2f} {row['load_s']:>7.1f} {row['decode_ms']:>9.3f} "
            f"{row['roofline_ms']:>9.3f} {row['tokens_per_s']:>9,.0f}{'' if row['complete'] else ' (partial)'}")
    return rows
