"""Logits processing and seeded sampling for one step's batch.

Rows are processed together; each request keeps its own torch.Generator so that
a seeded request samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams
from .watermark import apply_watermark


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one request that produces a token this step."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # EOS and stop ids while min_tokens is not reached


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each sampled token (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampledTokens:
        raw_logits = logits
        logits = apply_penalties(logits, rows)
        logits = apply_bias_and_watermark(logits, rows)
        greedy = [r.params.greedy for r in rows]
        token_ids = logits.argmax(dim=-1)
        if not all(greedy):
            random_idx = [i for i, g in enumerate(greedy) if not g]
            random_rows = [rows[i] for i in random_idx]
            probs = _filtered_probs(logits[random_idx], [r.params for r in random_rows])
            token_ids[random_idx] = _sample(probs, [r.generator for r in random_rows])
        token_list = token_ids.tolist()
        return _with_logprobs(raw_logits, token_ids, token_list, rows)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties."""
    penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    banned = [i for i, r in enumerate(rows) if r.banned_token_ids]
    if not penalized and not banned:
        return logits
    logits = logits.clone()
    for i in banned:
        logits[i, list(rows[i].banned_token_ids)] = float("-inf")
    for i in penalized:
        params = rows[i].params
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(rows[i].prompt_token_ids + rows[i].output_token_ids)),
                                dtype=torch.long, device=logits.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                    values * params.repetition_penalty)
        if rows[i].output_token_ids and (params.presence_penalty or params.frequency_penalty):
            out = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros_like(row).scatter_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def apply_bias_and_watermark(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """OpenAI's logit_bias (added to the logits) and TGI's watermark, one scatter each."""
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < logits.shape[-1]]
    marked = [i for i, r in enumerate(rows) if r.params.watermark]
    if not biased and not marked:
        return logits
    logits = logits.clone()
    if biased:
        index = torch.tensor([(i, t) for i, t, _ in biased], device=logits.device).T
        values = torch.tensor([b for _, _, b in biased], device=logits.device, dtype=logits.dtype)
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    if marked:
        previous = [(rows[i].output_token_ids or rows[i].prompt_token_ids)[-1] for i in marked]
        apply_watermark(logits, marked, previous)
    return logits


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, vectorised over the rows."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    typical_p = [p.typical_p for p in params]
    if any(t < 1.0 for t in typical_p):
        logits = _typical(logits, typical_p)
    probs = torch.softmax(logits, dim=-1)
    if any(m > 0.0 for m in min_p):
        min_p_t = torch.tensor(min_p, device=device).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p_t
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cumulative_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= cumulative_before >= p  # keep the smallest prefix whose mass reaches p (always >= 1 token)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _typical(logits: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.): keep the tokens whose surprisal is
    closest to the entropy until their mass reaches typical_p (rows at 1.0 untouched)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.masked_fill(probs == 0, 0.0)).sum(-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1)
    sorted_probs = probs.gather(-1, order)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    mass = torch.tensor(typical_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    drop_sorted = (mass_before >= mass) & (mass < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) drawn from each
    request's own generator, equivalent to multinomial and free of host syncs."""
    noise = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _with_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, token_list: list[int],
                   rows: list[SampleRow]) -> SampledTokens:
    wanted = [r.params.logprobs is not None for r in rows]
    if not any(wanted):
        return SampledTokens(token_list, None, None)
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(r.params.logprobs or 0 for r in rows)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    tops: list[list[tuple[int, float]]] = []
    for i, r in enumerate(rows):
        n = r.params.logprobs or 0
        tops.append(list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())) if n else [])
    return SampledTokens(token_list, chosen, tops)


def prompt_token_logprobs(logits: torch.Tensor, target_ids: list[int], num_top: int
                          ) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """(token id, its log-probability, top-n (id, logprob)) for each target, scored by
    the logits row before it."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(target_ids)
    return list(zip(target_ids, chosen, tops))
