"""The n-gram proposer, the acceptance rule and the KV manager's speculative slots."""
from switchyard.core.kv import BlockPool, KVCacheManager
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.spec import NgramProposer, num_accepted


def _request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=100))


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    request = _request([7, 1, 2, 3, 4, 5, 9, 2, 3, 8, 1, 2, 3])
    # suffix (1, 2, 3) matched at positions 1..3 (2, 3 alone matched later, at 7..8)
    assert proposer.propose([(request, 3)]) == [[4, 5, 9]]
    request.output_token_ids.append(4)
    assert proposer.propose([(request, 2)]) == [[5, 9]]  # the index grows with the new token
    assert NgramProposer(min_n=2, max_n=3).propose([(_request([5, 6, 1, 2, 7]), 2)]) == [[]]
    assert NgramProposer(1, 3, window=4).propose([(_request([1, 9, 0, 0, 0, 0, 1]), 2)]) == [[]]
    # one call for a batch, in order
    assert proposer.propose([(_request([3, 1, 3], "a"), 1), (_request([8, 8], "b"), 3)]) == [[1], [8]]


def test_acceptance_is_the_common_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([], [3]) == 0


def test_lookahead_slots_are_given_back_and_only_accepted_blocks_cached():
    manager = KVCacheManager(BlockPool(16), block_size=4)
    request = _request(range(1, 7))
    assert manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    request.output_token_ids.append(50)
    free = manager.num_free_blocks
    assert manager.allocate_slots(request, 1, num_lookahead=6)  # positions 6..12: blocks 2, 3, 4
    assert len(request.block_ids) == 4 and manager.num_free_blocks == free - 2
    cached_before = manager.block_pool.num_cached_blocks
    # two proposals accepted + the corrected token: computed 6 + 1 + 2 = 9
    request.output_token_ids += [51, 52, 53]
    request.num_computed_tokens = 9
    manager.settle_speculation(request, 7)
    assert len(request.block_ids) == 3 and manager.num_free_blocks == free - 1
    assert manager.block_pool.num_cached_blocks == cached_before + 1  # block 1 (positions 4..7) is full now


def test_flags_build_the_config_and_refuse_bad_values():
    import argparse

    import pytest

    from switchyard.core.config import SpeculativeConfig
    from switchyard.core.params import ValidationError
    from switchyard.gateway.speculate_flags import add_speculate_flags, speculative_config

    parser = argparse.ArgumentParser()
    add_speculate_flags(parser, {"SPECULATE": "3"})
    config = speculative_config(parser.parse_args([]))
    assert config.num_speculative_tokens == 3 and config.method == "ngram" and config.adaptive
    assert speculative_config(parser.parse_args(["--speculate", "0"])).enabled is False
    for argv in (["--speculative-model", "x", "--speculate", "0"], ["--speculate", "-1"],
                 ["--speculate-ngram-min", "5"]):
        with pytest.raises(ValidationError):
            speculative_config(parser.parse_args(argv))
    plain = argparse.ArgumentParser()
    add_speculate_flags(plain, {})
    assert speculative_config(plain.parse_args([])).enabled is False
    draft = speculative_config(plain.parse_args(["--speculative-model", "/models/draft"]))
    assert (draft.method, draft.draft_model, draft.num_speculative_tokens) == ("draft", "/models/draft", 4)
    two = speculative_config(plain.parse_args(["--speculative-model", "d", "--speculate", "2"]))
    assert two.num_speculative_tokens == 2
    from_env = argparse.ArgumentParser()
    add_speculate_flags(from_env, {"SPECULATIVE_MODEL": "/env/draft"})
    assert speculative_config(from_env.parse_args([])).draft_model == "/env/draft"
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=4, method="draft")  # a draft method needs its model


def test_a_backend_without_multi_token_decode_turns_speculation_off(caplog):
    from dataclasses import replace

    from switchyard.core.backend_contract import Capabilities
    from switchyard.core.capabilities import check_capabilities
    from switchyard.core.config import EngineConfig, SpeculativeConfig

    config = EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=4))
    caps = Capabilities(dtypes=("float32",), block_sizes=(16,))
    with caplog.at_level("INFO"):
        assert check_capabilities("x", caps, config).speculative.num_speculative_tokens == 0
    assert "speculative decoding off" in caplog.text
    kept = check_capabilities("x", replace(caps, multi_token_decode=True), config)
    assert kept.speculative.num_speculative_tokens == 4


# -- adaptive sizing (core/spec/adaptive.py, core/spec/cost.py) --------------------------------------
def test_proposals_pay_for_their_rows_at_the_steps_size():
    from switchyard.core.spec.adaptive import proposal_lengths

    # one request that copies (0.9 a position) on a CPU-like row cost: several proposals
    assert proposal_lengths([0.9], [5], num_decodes=1, row_cost=0.15) == [5]
    # a batch of 32 at 0.9: a row costs about what it brings, nobody proposes; at 0.97 some do,
    # one token each, until the rows they add raise the bar above 0.97
    assert proposal_lengths([0.9] * 32, [5] * 32, num_decodes=32, row_cost=0.15) == [0] * 32
    assert 0 < sum(proposal_lengths([0.97] * 32, [5] * 32, num_decodes=32, row_cost=0.15)) < 32
    # chat-like acceptance at a batch of 8: not worth a row
    assert proposal_lengths([0.45] * 8, [5] * 8, num_decodes=8, row_cost=0.15) == [0] * 8
    # rows almost free (a GPU): everyone proposes everything it may
    assert proposal_lengths([0.5, 0.8], [3, 4], num_decodes=2, row_cost=0.001) == [3, 4]
    # the better-accepted request gets the rows first; the floor rules a request out
    one, two = proposal_lengths([0.95, 0.3], [5, 5], num_decodes=2, row_cost=0.15)
    assert one > two
    assert proposal_lengths([0.95, 0.3], [5, 5], num_decodes=2, row_cost=0.15, floor=0.5)[1] == 0


def test_the_row_cost_is_fitted_from_decode_steps():
    from switchyard.core.spec.cost import StepCost

    cost = StepCost(prior=0.1)
    for _ in range(10):
        cost.observe(1, 0.0085)
    assert cost.row_cost == 0.1  # one row count only: nothing to fit yet
    for rows in (1, 2, 4, 6, 8) * 10:
        cost.observe(rows, 0.0073 + 0.0012 * rows)
    assert abs(cost.row_cost - 0.0012 / 0.0073) < 1e-6


def test_acceptance_is_estimated_per_position_around_the_shared_rate():
    from switchyard.core.spec.adaptive import AcceptanceTracker, SharedAcceptance

    shared = SharedAcceptance()
    copying, novel = AcceptanceTracker(shared), AcceptanceTracker(shared)
    start = copying.rate
    for _ in range(6):
        copying.record(5, 5)
        novel.record(5, 0)
    assert copying.rate > 0.9 > start > novel.rate
    for _ in range(100):
        novel.idle()
    assert abs(novel.rate - shared.rate) < 0.05  # not proposing, it drifts back to the shared rate
