"""A draft model (--speculative-model, core/spec/draft.py) through EngineCore on tiny random Llama
models and the real CPU backend: a draft equal to the target accepts every greedy proposal; a
different draft (the target's weights plus noise, same vocabulary) gives the target's exact
greedy tokens with partial acceptance; seeded sampling gives the tokens it gives without
speculation; mixed batches, preemption, a full draft cache, prompt catch-up in chunks and abort
leak no block in either cache; a draft without the target's tokenizer is refused in one line."""
import pytest

from spec_helpers import draft_free_blocks, free_blocks, make_engine, run, save_tiny_llama
from switchyard.core.params import SamplingParams
from switchyard.core.spec.draft import DraftModelError

# Repetitive prompts; the last one is longer than the small budget below (caught up in chunks).
PROMPTS = [[1, 5, 9, 13, 17, 5, 9, 13, 17, 5, 9], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6],
           [1] + [40, 41, 42, 43, 44] * 6, [1, 80, 81, 82, 80, 81, 82, 80]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("tiny-llama-draft")
    target = save_tiny_llama(root / "target", default_tokenizer)
    return {"target": target,
            "noisy": save_tiny_llama(root / "noisy", default_tokenizer, perturb=(target, 0.3)),
            "small": save_tiny_llama(root / "small", default_tokenizer, seed=5, num_layers=1),
            "vocab": save_tiny_llama(root / "vocab", default_tokenizer, vocab_size=128),
            "tokenizer": _with_other_tokenizer(root / "tokenizer")}


def _with_other_tokenizer(path):
    from switchyard.core.loader.named_configs import dummy_tokenizer

    return save_tiny_llama(path, dummy_tokenizer(96, 1, 95))  # same logits width, other token strings


@pytest.fixture(scope="module")
def expected(models):
    return run(make_engine(models["target"]), PROMPTS, GREEDY)


def test_a_draft_equal_to_the_target_accepts_every_greedy_proposal(models, expected):
    engine = make_engine(models["target"], speculate=4, draft=models["target"])
    free, draft_free = free_blocks(engine), draft_free_blocks(engine)
    got, _, _, steps = run(engine, PROMPTS, GREEDY)
    assert got == expected[0]
    stats = engine.scheduler.speculator.stats
    assert stats.num_proposed > 0 and stats.num_accepted == stats.num_proposed  # acceptance rate 1.0
    assert steps < expected[3] // 3
    assert free_blocks(engine) == free and draft_free_blocks(engine) == draft_free
    assert engine.scheduler.speculator.proposer.num_sequences == 0


@pytest.mark.parametrize("draft", ["noisy", "small"])
def test_another_draft_gives_the_target_greedy_tokens(models, expected, draft):
    engine = make_engine(models["target"], speculate=3, draft=models[draft])
    got, _, _, _ = run(engine, PROMPTS, GREEDY)
    assert got == expected[0]
    stats = engine.scheduler.speculator.stats
    assert stats.num_proposed > 0 and stats.num_accepted < stats.num_proposed
    if draft == "noisy":  # agrees often, not always
        assert stats.num_accepted > 0


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(models):
    params = [SamplingParams(temperature=0.5, top_k=20, top_p=0.9, seed=11 + i, max_tokens=30, ignore_eos=True,
                             repetition_penalty=1.1) for i in range(len(PROMPTS))]
    reference, _, _, _ = run(make_engine(models["target"]), PROMPTS, params)
    engine = make_engine(models["target"], speculate=4, draft=models["noisy"])
    got, _, _, _ = run(engine, PROMPTS, params)
    assert got == reference
    assert engine.scheduler.speculator.stats.num_accepted > 0


def test_mixed_batch_preemption_full_draft_cache_and_abort_leak_nothing(models):
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=25, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(3,), min_tokens=4),
              SamplingParams(temperature=0.8, seed=3, max_tokens=35, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    reference, reference_lp, reference_reasons, _ = run(make_engine(models["target"]), PROMPTS, params)
    # 30 target blocks of 4 tokens: preemptions; 14 draft blocks: some requests find no room;
    # a budget of 24: the 31-token prompt is caught up by the draft in two chunks
    engine = make_engine(models["target"], speculate=4, draft=models["target"], num_blocks=30, draft_blocks=14,
                         prefix_caching=False, budget=24)
    got, got_lp, reasons, _ = run(engine, PROMPTS, params)
    assert got == reference and reasons == reference_reasons
    assert got_lp["r0"] == pytest.approx(reference_lp["r0"], abs=1e-4)
    assert engine.scheduler.num_preemptions > 0
    proposer = engine.scheduler.speculator.proposer
    assert proposer.num_without_room > 0 and engine.scheduler.speculator.stats.num_accepted > 0
    assert free_blocks(engine) == 29 and draft_free_blocks(engine) == 13 and proposer.num_sequences == 0

    aborting = make_engine(models["target"], speculate=4, draft=models["noisy"], prefix_caching=False)
    draft_free = draft_free_blocks(aborting)
    got, _, _, _ = run(aborting, PROMPTS, GREEDY, abort_after=("r3", 3))
    assert len(got["r3"]) < 40
    assert draft_free_blocks(aborting) == draft_free and free_blocks(aborting) == 127
    assert not aborting.scheduler.speculator._trackers and aborting.scheduler.speculator.proposer.num_sequences == 0


@pytest.mark.parametrize("draft, words", [("vocab", "its vocabulary has 128 tokens, the model's 96"),
                                          ("tokenizer", "its tokenizer differs from the model's")])
def test_a_draft_without_the_target_tokenizer_is_refused_in_one_line(models, draft, words):
    with pytest.raises(DraftModelError) as refused:
        make_engine(models["target"], speculate=4, draft=models[draft])
    message = str(refused.value)
    assert words in message and "\n" not in message and message.startswith("--speculative-model ")


def test_every_proposal_is_the_draft_greedy_continuation_of_the_request_tokens(models):
    """The draft's cache follows each request through catch-up chunks, rejections (the target
    samples, with penalties), preemption and a full cache: each proposal run equals the draft
    model's own greedy continuation of the request's tokens, computed afresh by transformers."""
    import torch
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(models["noisy"]).eval()
    engine = make_engine(models["target"], speculate=3, draft=models["noisy"], num_blocks=30, draft_blocks=20,
                         prefix_caching=False, budget=24)
    proposer = engine.scheduler.speculator.proposer
    propose, checked = proposer.propose, []

    def checked_propose(slots):
        proposals = propose(slots)
        for (request, _), tokens in zip(slots, proposals):
            if tokens:
                greedy = request.all_token_ids
                with torch.no_grad():
                    for _ in tokens:
                        greedy = greedy + [int(reference(torch.tensor([greedy])).logits[0, -1].argmax())]
                assert tokens == greedy[request.num_tokens:], request.request_id
                checked.append(len(tokens))
        return proposals

    proposer.propose = checked_propose
    params = [SamplingParams(temperature=0.2, seed=i, max_tokens=30, ignore_eos=True, repetition_penalty=1.05)
              for i in range(len(PROMPTS))]
    run(engine, PROMPTS, params)
    assert len(checked) > 20 and engine.scheduler.num_preemptions > 0
    assert 0 < engine.scheduler.speculator.stats.num_accepted < engine.scheduler.speculator.stats.num_proposed
