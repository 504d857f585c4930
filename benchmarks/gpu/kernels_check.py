"""Section 1: every Triton kernel against its plain-torch reference (core/ops, core/layers)
at Llama-3-8B shapes in bf16: KV write, paged attention on a decode batch and on a mixed
batch (decodes plus prompt chunks with cached prefixes, with and without a sliding
window), fused RMSNorm, rotary and SiLU-and-mul, and the dequantize-GEMM of quantized
weights (GPTQ-style q4_0 in groups of 128, Q4_K, Q6_K, Q8_0) with its time per call."""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from switchyard.core.backend import AttentionMetadata, AttentionSpec


def make_batch(query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int,
               device: torch.device, seed: int) -> AttentionMetadata:
    """Metadata of requests with query_lens new tokens after context_lens cached ones,
    decodes first, on randomly drawn distinct blocks (block 0 reserved)."""
    rng = random.Random(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    per_request = [-(-s // block_size) for s in seq_lens]
    pool = rng.sample(range(1, num_blocks), sum(per_request))
    tables, slots, offset = [], [], 0
    for n, seq_len, q_len in zip(per_request, seq_lens, query_lens):
        blocks = pool[offset:offset + n]
        offset += n
        tables.append(blocks + [0] * (max(per_request) - n))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_decodes = sum(1 for q in query_lens if q == 1)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_decodes=num_decodes,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(seq_lens))


def _report(log, name: str, shape: str, out, ref, tolerance: tuple[float, float]) -> bool:
    """Max |err| and whether every element is within atol + rtol * |ref| (bf16: ~2 ulps)."""
    atol, rtol = tolerance
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    ok = bool((diff <= atol + rtol * ref.abs()).all())
    log(f"  {name:<34} {shape:<34} max |err| {diff.max().item():.3e}  (max |ref| {ref.abs().max().item():.2e}; "
        f"atol {atol:g} + rtol {rtol:g}) {'OK' if ok else 'MISMATCH'}")
    return ok


def check_attention(log, device, dtype, shapes) -> bool:
    from switchyard.backends.cuda.attention import TritonAttentionKernel
    from switchyard.core.ops.attention import paged_attention_reference, write_kv_reference

    heads, kv_heads, head_dim, block_size, num_blocks = shapes["attention"]
    ok = True
    for name, query_lens, context_lens, window in shapes["batches"]:
        spec = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                             scale=head_dim ** -0.5, dtype=dtype, sliding_window=window)
        meta = make_batch(query_lens, context_lens, block_size, num_blocks, device, seed=len(name))
        generator = torch.Generator(device=device).manual_seed(0)
        cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=generator, device=device,
                            dtype=dtype)
        tokens = len(meta.slot_mapping)
        key, value = (torch.randn((tokens, kv_heads, head_dim), generator=generator, device=device, dtype=dtype)
                      for _ in range(2))
        query = torch.randn((tokens, heads, head_dim), generator=generator, device=device, dtype=dtype)
        kernel = TritonAttentionKernel(spec)
        expected_cache = cache.clone()
        write_kv_reference(key, value, expected_cache, meta.slot_mapping)
        kernel.write_kv(key, value, cache, meta)
        label = f"{len(query_lens)} req, {tokens} tok, max ctx {meta.max_seq_len}"
        ok &= _report(log, f"write_kv ({name})", label, cache, expected_cache, (0.0, 0.0))
        out = kernel.forward(query, cache, meta)
        ref = paged_attention_reference(query, cache, list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu),
                                        meta.block_table, spec.scale, window)
        ok &= _report(log, f"paged attention ({name})", label, out, ref, shapes["attention_tol"])
    return ok


def check_fused(log, device, dtype, shapes) -> bool:
    from switchyard.backends.cuda import kernels
    from switchyard.core.layers import RMSNorm, SiluAndMul, apply_rotary
    from switchyard.core.layers.rotary import RotaryEmbedding

    tokens, hidden, intermediate, heads, head_dim = shapes["fused"]
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn((tokens, hidden), generator=generator, device=device, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5, dtype=dtype).to(device)
    norm.weight.data.uniform_(0.5, 1.5, generator=generator)
    ok = _report(log, "fused rms_norm", f"[{tokens}, {hidden}]", kernels.rms_norm(x, norm.weight, 1e-5), norm(x),
                 shapes["fused_tol"])
    residual = torch.randn_like(x)
    out, summed = kernels.rms_norm(x, norm.weight, 1e-5, residual=residual.clone())
    ok &= _report(log, "fused add + rms_norm", f"[{tokens}, {hidden}]", out, norm(x + residual), shapes["fused_tol"])
    gate_up = torch.randn((tokens, 2 * intermediate), generator=generator, device=device, dtype=dtype)
    ok &= _report(log, "fused silu_and_mul", f"[{tokens}, {2 * intermediate}]", kernels.silu_and_mul(gate_up),
                  SiluAndMul()(gate_up), shapes["fused_tol"])
    rotary = RotaryEmbedding(head_dim, 500000.0).to(device)
    positions = torch.randint(0, 8192, (tokens,), generator=generator, device=device)
    cos, sin = rotary(positions, dtype)
    qk = torch.randn((tokens, heads, head_dim), generator=generator, device=device, dtype=dtype)
    ok &= _report(log, "fused rotary (q and k heads)", f"[{tokens}, {heads}, {head_dim}]",
                  kernels.apply_rotary(qk, cos, sin), apply_rotary(qk, cos, sin), shapes["fused_tol"])
    return ok


def check_dequant_gemm(log, device, dtype, shapes) -> bool:
    """The Triton dequantize-GEMM (backends/cuda/kernels/dequant_gemm.py) against x @ W^T of the
    weight's own dequantization (float32), and its time per call (weight bytes read per second)."""
    from switchyard.backends.cuda.kernels import dequant_gemm
    from switchyard.backends.cuda.quant import pack_weight
    from switchyard.core.quant.hub.blocks import to_quantized
    from switchyard.core.testing.quant_blocks import random_blocks

    ok = True
    generator = torch.Generator().manual_seed(2)
    for fmt, n, k in shapes["dequant"]:
        if fmt == "gptq":  # symmetric 4-bit in groups of 128, as core converts a GPTQ layer (q4_0 blocks)
            scales = torch.rand(n, k // 128, generator=generator) * 0.004 + 0.002
            weight = to_quantized(torch.randint(0, 16, (n, k), generator=generator), scales,
                                  torch.full((n, k // 128), 8), 4, "a layer")
        else:  # random blocks, scales shrunk so that outputs stay in bf16's range
            weight = random_blocks(fmt, n, k // (256 if fmt.endswith("_k") else 32), seed=3, scale=(1e-4, 1e-3))
        (packed,) = pack_weight(weight, device)
        reference_weight = replace(weight, data=weight.data.to(device)).dequantize()  # core's, on the device
        for rows in shapes["dequant_rows"]:
            x = torch.randn((rows, k), generator=generator).to(device, dtype)
            out = dequant_gemm(x, packed)
            ref = x.float() @ reference_weight.T
            ok &= _report(log, f"dequant_gemm {fmt} (groups of {packed.group})", f"[{rows}, {k}] x [{n}, {k}]^T",
                          out, ref, (shapes["dequant_tol"] * ref.abs().max().item(), 0.0))
            ms = _time_ms(lambda: dequant_gemm(x, packed), device)
            if ms is not None:
                log(f"    {ms * 1e3:.1f} us a call: {packed.nbytes / ms / 1e6:.0f} GB/s of packed weight read")
    return ok


def _time_ms(run, device, iterations: int = 20) -> float | None:
    """Mean GPU time of one call (after one untimed call); None off the GPU."""
    if device.type != "cuda":
        return None
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iterations


LLAMA3_8B_SHAPES = dict(
    attention=(32, 8, 128, 16, 8192),  # heads, kv heads, head dim, block size, blocks in the cache
    batches=[("decode", [1] * 64, [random.Random(i).randint(1, 4000) for i in range(64)], None),
             ("mixed", [1] * 16 + [512, 300, 77, 1024], [900] * 16 + [0, 256, 1000, 64], None),
             ("mixed, window 512", [1] * 8 + [700, 100], [3000] * 8 + [0, 2000], 512)],
    attention_tol=(2e-2, 2e-2), fused=(512, 4096, 14336, 40, 128), fused_tol=(1e-2, 2e-2),
    dequant=[("gptq", 6144, 4096), ("gptq", 4096, 14336), ("q4_k", 28672, 4096), ("q6_k", 4096, 4096)],
    dequant_rows=(1, 16, 256), dequant_tol=2e-2)
SMOKE_SHAPES = dict(
    attention=(4, 2, 16, 4, 64), batches=[("decode", [1] * 3, [5, 9, 17], None),
                                         ("mixed", [1, 1, 7, 5], [3, 12, 0, 6], None),
                                         ("mixed, window 4", [1, 6], [9, 5], 4)],
    attention_tol=(2e-2, 2e-2), fused=(8, 64, 96, 6, 16), fused_tol=(1e-2, 2e-2),
    dequant=[("gptq", 72, 256), ("q4_k", 40, 256), ("q6_k", 24, 256), ("q8_0", 40, 96)], dequant_rows=(1, 17),
    dequant_tol=2e-2)


def run(log, device: torch.device, smoke: bool) -> bool:
    shapes = SMOKE_SHAPES if smoke else LLAMA3_8B_SHAPES
    dtype = torch.bfloat16
    log("kernels vs references (reference attention: float32 per request from the definition; "
        "bf16 inputs, bf16 outputs)")
    ok = check_attention(log, device, dtype, shapes)
    ok &= check_fused(log, device, dtype, shapes)
    ok &= check_dequant_gemm(log, device, dtype, shapes)
    log(f"all kernels within tolerance: {ok}")
    return ok
