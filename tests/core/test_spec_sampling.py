"""Rejection sampling of speculative tokens keeps the target's distribution: over many unseeded
samples from a tiny model with an 8-token vocabulary, the frequencies of each generated position
(and of the first two tokens jointly) with --speculate agree with those without it under a
chi-square test of homogeneity at significance 0.001 each. The requests carry no seed of their own
(a seeded request replays its tokens under speculation), so they share the engine's generator, which
each run seeds differently (EngineConfig.sampling_seed): agreement is statistical, not by replay, and
the outcome is the same every run. (Seeded at random, as it was, each run had about a 2% chance,
twenty checks at 0.001, of failing one; CI met one.) The proposals come from n-gram lookup, or
from a greedy draft model (the target's weights plus noise): either is a point mass."""
import pytest
import torch

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

chi2 = pytest.importorskip("scipy.stats").chi2

VOCAB = 8
NUM_SAMPLES = 1500
NUM_TOKENS = 4
ALPHA = 0.001


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, default_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=7, bos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked enough that proposals are accepted and rejected
    path = tmp_path_factory.mktemp("tiny-vocab8")
    model.save_pretrained(path, safe_serialization=True)
    default_tokenizer.save_pretrained(path)  # a draft model's tokenizer is checked against it
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * weight.std() * 0.5)
    draft = tmp_path_factory.mktemp("tiny-vocab8-draft")
    model.save_pretrained(draft, safe_serialization=True)
    default_tokenizer.save_pretrained(draft)
    return str(path), str(draft)


def _samples(model_dir, speculate, params, draft=None):
    engine = EngineCore(EngineConfig(
        sampling_seed=20261206 + speculate,  # the generator unseeded requests share: one fixed draw per run
        model=ModelConfig(model=model_dir), cache=CacheConfig(block_size=4, num_blocks=4096),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=NUM_SAMPLES),
        speculative=SpeculativeConfig(num_speculative_tokens=speculate, adaptive=False,
                                      method="draft" if draft else "ngram", draft_model=draft), backend="cpu"))
    prompt = [1, 2, 3, 4, 2, 3, 4, 2, 3]  # repetitive: n-gram lookup proposes from the first step on
    for i in range(NUM_SAMPLES):
        engine.add_request(Request(f"s{i}", list(prompt), params))
    outputs = {f"s{i}": [] for i in range(NUM_SAMPLES)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    stats = engine.scheduler.speculator.stats if speculate else None
    return [tuple(v) for v in outputs.values()], stats


def _homogeneous(a: list, b: list) -> float:
    """The p-value of a chi-square test that the two samples come from one distribution."""
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(c) for c in cells], [b.count(c) for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    return float(chi2.sf(statistic, len(cells) - 1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, max_tokens=NUM_TOKENS,
                   ignore_eos=True),
], ids=["plain", "top-k-top-p-penalty"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_token_frequencies_agree_with_and_without_speculation(small_vocab_model, params, proposer):
    target, draft = small_vocab_model
    reference, _ = _samples(target, 0, params)
    speculative, stats = _samples(target, 3, params, draft if proposer == "draft" else None)
    assert all(len(s) == NUM_TOKENS for s in reference + speculative)
    assert 0 < stats.num_accepted < stats.num_proposed  # both acceptance and rejection were exercised
    for position in range(NUM_TOKENS):
        p = _homogeneous([s[position] for s in reference], [s[position] for s in speculative])
        assert p > ALPHA, f"position {position}: p = {p}"
    assert _homogeneous([s[:2] for s in reference], [s[:2] for s in speculative]) > ALPHA
