"""Sections 2 and 3 on our engine: batch-1 decode latency next to the weight-read roofline,
and output throughput on a batch of random requests."""
from __future__ import annotations

import statistics
import time

import torch

from common import Deadline, drive, random_prompts, synchronize


def build_engine(log, backend, model: str, dtype: str, max_num_seqs: int, max_batched_tokens: int,
                 max_model_len: int | None, quantize: str | None = None, load_format: str = "dummy"):
    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from switchyard.core.engine.core import EngineCore

    config = EngineConfig(model=ModelConfig(model=model, dtype=dtype, load_format=load_format, seed=0,
                                            max_model_len=max_model_len, quantize=quantize),
                          cache=CacheConfig(block_size=16),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens))
    start = time.perf_counter()
    engine = EngineCore(config, backend=backend)
    runner, info, gib = engine.runner, engine.info, 2**30
    log(f"engine ready in {time.perf_counter() - start:.1f}s: {model} {dtype}, backend {backend.name}, "
        f"attention {sorted({c.reason for c in backend.attention_choices.values()})}, fused {backend.fused}"
        + (f", quantized linears {backend.quantized}" if backend.quantized else ""))
    profile = backend.memory_profile
    log(f"  warm-up profile: {profile.free_bytes / gib:.1f} GiB free of {profile.total_bytes / gib:.1f} GiB, "
        f"activation peak {profile.activation_peak_bytes / gib:.2f} GiB -> {info.num_kv_blocks} KV blocks, "
        f"max_batch_total_tokens {info.max_batch_total_tokens}")
    log(f"  CUDA graphs: {len(runner.graphs)} buckets {runner.sizes[:4]}..{runner.sizes[-1:]}"
        if runner.graphs else f"  CUDA graphs off: {runner.disabled_reason}")
    return engine


def copy_bandwidth(device: torch.device, num_bytes: int, iterations: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        begin = time.perf_counter()
        for _ in range(iterations):
            dst.copy_(src)
        seconds = time.perf_counter() - begin
    return 2 * num_bytes * iterations / seconds


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes a decode step reads: every weight except the embedding table, of which one
    row is gathered; all weight bytes)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    tied = getattr(model, "tie_word_embeddings", False)  # then the table is read whole as the LM head
    read = total if tied else total - embedding.numel() * embedding.element_size()
    return read + embedding.shape[1] * embedding.element_size(), total


def time_graph_replays(graph, iterations: int) -> float:
    """Mean GPU time of one replay of a captured graph (after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iterations


def graph_replay_ms(engine, device: torch.device, iterations: int) -> float | None:
    """GPU time of one batch-1 graph replay (the device's share of a decode step)."""
    graph = engine.runner.graphs.get(1)
    if graph is None or device.type != "cuda":
        return None
    return time_graph_replays(graph, iterations)


def matmul_floor_ms(model, device: torch.device, iterations: int) -> float | None:
    """GPU time of a batch-1 step's weight matmuls alone (every projection and the LM head,
    through the model's own Linear modules or the quantized ones that replaced them), replayed
    as one graph: what the weight reads cost before any attention, norm or launch gap."""
    if device.type != "cuda":
        return None
    from switchyard.backends.cuda.quant_linear import CudaQuantLinear
    from switchyard.core.layers import Linear

    linears = [m for m in model.modules() if isinstance(m, (Linear, CudaQuantLinear))]
    dtype = model.model.embed_tokens.weight.dtype  # the activations' (a quantized linear has no float weight)
    inputs = [torch.randn(1, m.in_features, device=device, dtype=dtype) for m in linears]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(stream):
        for m, x in zip(linears, inputs):
            m(x)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
        for m, x in zip(linears, inputs):
            m(x)
    return time_graph_replays(graph, iterations)


def kernel_breakdown(log, engine, device: torch.device, rows: int = 12) -> None:
    """The GPU kernels of one eager batch-1 decode step, by total time (torch.profiler)."""
    if device.type != "cuda" or 1 not in engine.runner.sizes:
        return
    from torch.profiler import ProfilerActivity, profile

    run = engine.runner._decode_fn(1)  # the captured work, run eagerly on the last staged step
    with torch.inference_mode():
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    log(f"one eager batch-1 step on the GPU: {sum(e.count for e in events)} kernels, {total / 1e3:.3f} ms of kernel time")
    for e in events[:rows]:
        log(f"  {e.self_device_time_total / 1e3:8.3f} ms  {e.count:5d}x  {e.key[:90]}")


def decode_latency(log, engine, device: torch.device, args) -> dict:
    vocab = engine.loaded.vocab_size
    prompt = random_prompts(1, args.decode_prompt_len, args.decode_prompt_len, vocab, seed=1)
    drive(engine, prompt, 4, prefix="warm-decode")  # compiles what is left to compile
    result = drive(engine, prompt, args.decode_tokens + 1, prefix="decode")
    decode_steps = result["step_times"][1:]  # the first step is the prompt
    median_ms = statistics.median(decode_steps) * 1e3
    mean_ms = statistics.fmean(decode_steps) * 1e3
    bandwidth = args.copy_bandwidth or copy_bandwidth(device, args.copy_bytes // 8, args.copy_iterations)
    read, total = weight_bytes(engine.loaded.model)
    roofline_ms = read / bandwidth * 1e3
    replay_ms = graph_replay_ms(engine, device, 50)
    log(f"device-to-device copy bandwidth: {bandwidth / 1e12:.3f} TB/s (bytes read + bytes written per second; "
        "measured before the engine started)")
    log(f"weights: {total / 1e9:.3f} GB in all; a decode step reads {read / 1e9:.3f} GB (every weight but the "
        f"embedding table, of which it gathers one row)")
    log(f"roofline (weight bytes read / copy bandwidth): {roofline_ms:.3f} ms/token")
    log(f"batch-1 decode, CUDA graphs on, prompt {args.decode_prompt_len}, {len(decode_steps)} tokens: "
        f"median {median_ms:.3f} ms/token, mean {mean_ms:.3f} ms/token (whole engine step: schedule, "
        f"replay, sample, read the id)")
    if replay_ms is not None:
        log(f"  of which one batch-1 graph replay on the GPU: {replay_ms:.3f} ms")
    floor_ms = matmul_floor_ms(engine.loaded.model, device, 20)
    if floor_ms is not None:
        log(f"  the step's weight matmuls alone, as one graph: {floor_ms:.3f} ms "
            f"({read / floor_ms / 1e9:.2f} TB/s of weights)")
    ratio = median_ms / roofline_ms
    try:
        kernel_breakdown(log, engine, device)
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        log(f"  (no kernel breakdown: {type(error).__name__}: {error})")
    log(f"RESULT decode/roofline = {ratio:.2f}x (aim: <= 1.3x) -> {'MET' if ratio <= 1.3 else 'NOT MET'}")
    return dict(median_ms=median_ms, roofline_ms=roofline_ms, ratio=ratio, bandwidth=bandwidth)


def throughput(log, engine, prompts: list[list[int]], new_tokens: int, deadline: Deadline, args) -> dict:
    vocab = engine.loaded.vocab_size
    warm = random_prompts(args.warm_requests, 3, args.prompt_max, vocab, seed=2)
    drive(engine, warm, 8, prefix="warm")  # prompt-chunk kernel variants compile here, not in the timing
    runner = engine.runner
    replays_before = runner.num_replays
    prompt_tokens = sum(len(p) for p in prompts)
    log(f"{len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"({prompt_tokens} in all), {new_tokens} new tokens each, greedy, EOS ignored; "
        f"max_num_seqs {engine.config.scheduler.max_num_seqs}, "
        f"max_num_batched_tokens {engine.config.scheduler.max_num_batched_tokens}")
    result = drive(engine, prompts, new_tokens, deadline, prefix="tput")
    tps = result["output_tokens"] / result["elapsed"]
    replays = runner.num_replays - replays_before
    note = "" if result["complete"] else (f" (stopped at the time budget: {result['finished']} of "
                                          f"{len(prompts)} requests finished; only theirs are counted)")
    log(f"switchyard: {result['output_tokens']} output tokens in {result['elapsed']:.2f}s = {tps:,.0f} tokens/s "
        f"over {result['steps']} steps ({replays} graph replays){note}")
    return dict(tokens_per_s=tps, **{k: v for k, v in result.items() if k != "step_times"})


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """How many leading tokens two greedy runs share, request by request."""
    counts = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts
