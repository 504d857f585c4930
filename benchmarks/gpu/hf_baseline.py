"""Section 3's baseline: transformers' own continuous batching (`generate_batch`, paged
attention over its paged cache) on a LlamaForCausalLM holding the same weights as our
model, on the same requests, greedy with EOS disabled."""
from __future__ import annotations

import threading
import time

import torch

from common import Deadline

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def hf_model_from(loaded, device: torch.device, attn_implementation: str):
    """A transformers LlamaForCausalLM with our model's weights (fused projections split)."""
    from transformers import LlamaForCausalLM

    config = loaded.hf_config
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=loaded.dtype, attn_implementation=attn_implementation)
    model.eval()
    targets = dict(model.named_parameters())
    copied = set()
    for name, param in loaded.model.named_parameters():
        fused = next(((f, parts) for f, parts in FUSED.items() if f".{f}." in name), None)
        if fused is None:
            targets[name].copy_(param)
            copied.add(name)
            continue
        module = loaded.model.get_submodule(name.rsplit(".", 1)[0])
        pieces = param.split(list(module.output_sizes), dim=0)
        for part, piece in zip(fused[1], pieces):
            target = name.replace(f".{fused[0]}.", f".{part}.")
            targets[target].copy_(piece)
            copied.add(target)
    missing = set(targets) - copied
    if missing:
        raise ValueError(f"weights not copied into the transformers model: {sorted(missing)[:5]}")
    return model


def _generate_batch(model, prompts, new_tokens: int, timeout: float) -> tuple[dict | None, float]:
    """generate_batch in a thread, so that a run past its budget is reported, not waited for."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    box: dict = {}

    def target():
        try:
            box["out"] = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        except Exception as error:  # noqa: BLE001 - reported by the caller
            box["error"] = error

    start = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    wall = time.perf_counter() - start
    if "error" in box:
        raise box["error"]
    return box.get("out"), wall


def _summary(outputs: dict) -> tuple[int, float]:
    """(generated tokens, seconds from the first request's arrival to the last one's end)."""
    results = list(outputs.values())
    tokens = sum(len(r.generated_tokens) for r in results)
    first = min(r.created_time for r in results)
    last = max(r.lifespan[1] for r in results)
    return tokens, last - first


def token_ids(outputs: dict, num: int) -> list[list[int]]:
    """Generated ids of the first num requests, in input order (generate_batch keeps it)."""
    return [list(r.generated_tokens) for r in list(outputs.values())[:num]]


def run(log, model, prompts: list[list[int]], new_tokens: int, deadline: Deadline, first_subset: int) -> dict:
    """generate_batch on the first `first_subset` requests; then, if the budget allows on
    the pace seen, on as many as fit (all of them when they do). Both runs are reported."""
    results, subset = {}, min(first_subset, len(prompts))
    while subset:
        outputs, wall = _generate_batch(model, prompts[:subset], new_tokens, max(1.0, deadline.left()))
        if not outputs:
            why = "did not finish within the budget" if outputs is None else "returned no results (see its log)"
            log(f"transformers generate_batch on {subset} requests {why} ({wall:.0f}s): no figure for it")
            break
        tokens, span = _summary(outputs)
        complete = tokens == subset * new_tokens
        results[subset] = dict(tokens=tokens, seconds=span, tokens_per_s=tokens / span, wall=wall,
                               token_ids=token_ids(outputs, 8))
        log(f"transformers generate_batch, {subset} requests: {tokens} tokens in {span:.2f}s from first arrival to "
            f"last finish = {tokens / span:,.0f} tokens/s (call took {wall:.1f}s with its warm-up)"
            + ("" if complete else f" -- only {tokens} of {subset * new_tokens} tokens came back"))
        if subset == len(prompts):
            break
        per_request = wall / subset  # its pace, warm-up included: an overestimate for a larger batch
        fits = int(deadline.left() * 0.6 / per_request)
        subset = min(len(prompts), fits) if fits > subset else 0
    return results
