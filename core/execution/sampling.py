"""Logits processing and seeded sampling for one step's batch.

Rows are processed together; each request keeps its own torch.Generator so that
a seeded request samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..grammar.constrained import GrammarMask, apply_grammar_mask
from ..params import SamplingParams
from .watermark import apply_watermark


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one request that produces a token this step."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own; None = greedy or the shared one
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


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without blocking the host: staged through
    pinned memory and copied asynchronously on accelerators."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equals; NaN counts as largest),
    as Tensor.argmax, but through max(dim): its CPU kernel is about 1.7x faster over a
    vocabulary-wide row (49152 floats: 0.056 against 0.089 ms; 32 rows: 1.8 against 3.2 ms)."""
    return logits.max(dim=-1).indices


class Sampler:
    """Unseeded random rows share one generator (one noise launch for all of them), seeded
    with `seed` (EngineConfig.sampling_seed; None: at random); a seeded row draws from its
    own, so its tokens do not depend on its neighbours."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], grammar_mask: GrammarMask | None = None
                 ) -> SampledTokens:
        """`grammar_mask` sets the constrained rows' disallowed tokens to -inf before any
        other processing, so penalties, temperature, top-k/p, biases and seeds act on the
        masked distribution; log-probabilities stay those of the raw model."""
        raw_logits = logits
        if grammar_mask is not None:
            logits = apply_grammar_mask(logits, grammar_mask)
        logits = apply_penalties(logits, rows)
        logits = apply_bias_and_watermark(logits, rows)
        greedy = [r.params.greedy for r in rows]
        token_ids = argmax(logits)
        if not all(greedy):
            random_idx = [i for i, g in enumerate(greedy) if not g]
            random_rows = [rows[i] for i in random_idx]
            index = device_tensor(random_idx, torch.long, logits.device)
            probs = _filtered_probs(logits.index_select(0, index), [r.params for r in random_rows])
            sampled = _sample(probs, [r.generator for r in random_rows], self._shared_generator(logits.device))
            token_ids.index_copy_(0, index, sampled)
        token_list = token_ids.tolist()
        return _with_logprobs(raw_logits, token_ids, token_list, rows)


    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = make_generator(self._seed, device)
        return self._shared[device]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties and
    banned tokens, each one scatter over the whole batch."""
    penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
    if not penalized and not banned:
        return logits
    logits = logits.clone()
    device = logits.device
    if penalized:
        _apply_repetition(logits, rows, penalized)
        _apply_presence_frequency(logits, rows, penalized)
    if banned:
        index = device_tensor(banned, torch.long, device).T
        logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=device))
    return logits


def _apply_repetition(logits: torch.Tensor, rows: list[SampleRow], penalized: list[int]) -> None:
    wanted = [i for i in penalized if rows[i].params.repetition_penalty != 1.0]
    if not wanted:
        return
    pairs = [(i, t) for i in wanted for t in set(rows[i].prompt_token_ids + rows[i].output_token_ids)]
    index = device_tensor(pairs, torch.long, logits.device).T
    penalty = torch.ones(logits.shape[0], dtype=logits.dtype, device=logits.device)
    penalty.index_copy_(0, device_tensor(wanted, torch.long, logits.device),
                        device_tensor([rows[i].params.repetition_penalty for i in wanted], logits.dtype, logits.device))
    values = logits[index[0], index[1]]
    row_penalty = penalty[index[0]]
    logits[index[0], index[1]] = torch.where(values > 0, values / row_penalty, values * row_penalty)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SampleRow], penalized: list[int]) -> None:
    wanted = [i for i in penalized if rows[i].output_token_ids
              and (rows[i].params.presence_penalty or rows[i].params.frequency_penalty)]
    if not wanted:
        return
    pairs = [(i, t) for i in wanted for t in rows[i].output_token_ids]
    index = device_tensor(pairs, torch.long, logits.device).T
    counts = torch.zeros_like(logits)
    counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], dtype=logits.dtype, device=logits.device),
                      accumulate=True)
    chosen = set(wanted)
    per_row = [(r.params.frequency_penalty, r.params.presence_penalty) if i in chosen else (0.0, 0.0)
               for i, r in enumerate(rows)]
    weights = device_tensor(per_row, logits.dtype, logits.device)
    logits -= weights[:, :1] * counts + weights[:, 1:] * (counts > 0).to(logits.dtype)


def apply_bias_and_watermark(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """OpenAI's logit_bias (added to the logits) and TGI's watermark, one scatter each."""
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < logits.shape[-1]]
    marked = [i for i, r in enumerate(rows) if r.params.watermark]
    if not biased and not marked:
        return logits
    logits = logits.clone()
    if biased:
        index = device_tensor([(i, t) for i, t, _ in biased], torch.long, logits.device).T
        values = device_tensor([b for _, _, b in biased], logits.dtype, logits.device)
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
    temperature = device_tensor([p.temperature for p in params], logits.dtype, device).unsqueeze(1)
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
        min_p_t = device_tensor(min_p, probs.dtype, device).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p_t
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = device_tensor([kk if kk > 0 else vocab for kk in top_k], torch.long, logits.device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    p = device_tensor(top_p, torch.float32, logits.device).unsqueeze(1)
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
    mass = device_tensor(typical_p, probs.dtype, logits.device).unsqueeze(1)
    drop_sorted = (mass_before >= mass) & (mass < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _sample(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1), equivalent to
    multinomial and free of host syncs. Rows with a generator of their own redraw
    their noise from it."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_(generator=shared)
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return argmax(probs / noise)


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
