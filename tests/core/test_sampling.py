import torch

from switchyard.core.params import SamplingParams
from switchyard.core.execution.sampling import Sampler, SampleRow, _filtered_probs, make_generator

VOCAB = 50


def _row(params: SamplingParams, rid="r", output=(), prompt=(1, 2, 3), banned=()):
    gen = None if params.greedy else make_generator(params.seed, torch.device("cpu"))
    return SampleRow(rid, params, gen, list(prompt), list(output), tuple(banned))


def test_greedy_is_argmax():
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0.0), f"r{i}") for i in range(3)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_argmax_matches_torch_argmax_on_ties_infinities_and_nan():
    from switchyard.core.execution.sampling import argmax

    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-inf] * 4, [0.0, inf, inf, 1.0], [nan, 1.0, nan, 2.0]])
    assert argmax(rows).tolist() == rows.argmax(dim=-1).tolist() == [1, 0, 1, 0]
    ties = torch.randint(0, 4, (64, 1000), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(argmax(ties), ties.argmax(dim=-1))


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    target = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(neighbours: int) -> list[int]:
        row = _row(params)
        tokens = []
        for step in range(20):
            others = [_row(SamplingParams(temperature=0.7, seed=step + k), f"o{k}") for k in range(neighbours)]
            logits = torch.cat([torch.randn(neighbours, VOCAB), target])
            tokens.append(Sampler()(logits, others + [row]).token_ids[-1])
        return tokens

    alone, crowded = run(0), run(5)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_sampler_seed_fixes_the_shared_noise_of_unseeded_rows():
    """EngineConfig.sampling_seed (--seed): unseeded rows share one generator, seeded with it, so
    the same rows draw the same tokens in every engine started with that seed; without it each
    start seeds at random."""
    logits = torch.zeros(16, VOCAB)  # uniform: every token is a fresh draw
    rows = [SampleRow(f"r{i}", SamplingParams(temperature=1.0), None, [1, 2, 3], [], ()) for i in range(16)]

    def tokens(sampler: Sampler) -> list[int]:
        return sampler(logits, rows).token_ids + sampler(logits, rows).token_ids

    assert tokens(Sampler(7)) == tokens(Sampler(7))
    assert tokens(Sampler(7)) != tokens(Sampler(8))
    assert tokens(Sampler()) != tokens(Sampler())  # 32 uniform draws over 50 tokens: never all equal


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    logits = probs.log()
    row = _row(SamplingParams(temperature=1.0, seed=7))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[Sampler()(logits, [row]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs[0], atol=0.03)


def test_top_k_top_p_min_p_filter():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3)]
    probs = _filtered_probs(logits, params)
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    assert (probs[1] > 0).tolist() == [True, False, False, False, False]  # top token alone holds >= 0.5
    assert (probs[2] > 0).tolist() == [True, True, False, False, False]  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3


def test_repetition_presence_frequency_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.0
    logits[0, 6] = -2.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    from switchyard.core.execution.sampling import apply_penalties

    out = apply_penalties(logits, [_row(params, prompt=(5, 6))])
    assert out[0, 5] == 1.0 and out[0, 6] == -4.0
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [_row(params, output=(7, 7, 8))])
    assert out[0, 7] == -1.0 and out[0, 8] == -0.75 and out[0, 9] == 0.0


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 100.0
    row = _row(SamplingParams(temperature=0.0), banned=(3,))
    assert Sampler()(logits, [row]).token_ids[0] != 3


def test_logprobs_and_top_logprobs():
    logits = torch.randn(2, VOCAB)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=3), "a"), _row(SamplingParams(temperature=0.0), "b")]
    result = Sampler()(logits, rows)
    expected = torch.log_softmax(logits, -1)
    assert abs(result.logprobs[0] - expected[0].max().item()) < 1e-5
    assert [t for t, _ in result.top_logprobs[0]] == expected[0].topk(3).indices.tolist()
    assert result.top_logprobs[1] == []


def test_logit_bias_forces_and_bans_tokens_per_row():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0
    rows = [_row(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), "a"),
            _row(SamplingParams(temperature=0.0, logit_bias={7: -100.0, 9: 1.0}), "b"),
            _row(SamplingParams(temperature=0.0), "c")]
    assert Sampler()(logits, rows).token_ids == [3, 9, 7]
    assert SamplingParams(logit_bias=[(1, 2.0)]).logit_bias == ((1, 2.0),)


def test_typical_p_keeps_the_tokens_nearest_the_entropy():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    params = [SamplingParams(typical_p=0.5), SamplingParams(typical_p=1.0)]
    kept = _filtered_probs(probs.log().repeat(2, 1), params) > 0
    # entropy = 1.28 nats; surprisals 0.92, 1.20, 1.61, 2.30: nearest are token 1 (0.3), then
    # token 2 (0.2), which reach 0.5
    assert kept[0].tolist() == [False, True, True, False]
    assert kept[1].all()


def test_watermark_biases_towards_the_green_list_and_is_detectable():
    from switchyard.core.execution.watermark import detect

    vocab = 1000
    torch.manual_seed(0)
    marked, plain = [5], [5]
    generators = [make_generator(1, torch.device("cpu")), make_generator(2, torch.device("cpu"))]
    for step in range(200):
        logits = torch.randn(2, vocab)
        rows = [SampleRow("m", SamplingParams(temperature=1.0, watermark=True), generators[0], [1], marked),
                SampleRow("p", SamplingParams(temperature=1.0), generators[1], [1], plain)]
        tokens = Sampler()(logits, rows).token_ids
        marked.append(tokens[0])
        plain.append(tokens[1])
    assert detect(marked, vocab) > 4.0
    assert abs(detect(plain, vocab)) < 3.0
