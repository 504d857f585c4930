"""The CUDA graph runner on a CPU: bucketing, staging with padding, capture and replay
(fake graphs re-run what was captured), against the eager path token for token."""
from __future__ import annotations

import pytest
import torch

from cuda_fakes import CpuCudaBackend, FakeDevice, generate, make_engine
from switchyard.core.execution.decode_batch import bucket_for, capture_sizes
from switchyard.core.ops import ReferenceAttentionKernel
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput


def test_capture_sizes_are_powers_of_two_then_multiples_of_eight_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(30) == (1, 2, 4, 8, 16, 24, 30)
    assert capture_sizes(256)[-3:] == (240, 248, 256) and len(capture_sizes(256)) == 35
    assert capture_sizes(4096)[-1] == 512  # graphs past 512 rows gain nothing: those steps run eagerly


@pytest.mark.parametrize("num, expected", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (24, 24), (25, 30), (30, 30),
                                           (31, None)])
def test_bucket_is_the_smallest_size_that_holds_the_batch(num, expected):
    assert bucket_for(num, capture_sizes(30)) == expected


@pytest.fixture(scope="module")
def eager_tokens():
    return generate(make_engine(CpuCudaBackend(cuda_graphs=False)))


def test_decode_steps_replay_graphs_and_give_the_eager_tokens(eager_tokens):
    device = FakeDevice()
    engine = make_engine(CpuCudaBackend(device))
    runner = engine.runner
    assert runner.sizes == (1, 2, 4, 6) and sorted(runner.graphs) == [1, 2, 4, 6]
    assert list(device.captured.values()) == [runner.graphs[b] for b in (6, 4, 2, 1)]  # largest first
    assert all(g.num_replays == 0 for g in runner.graphs.values())  # capture records, it does not run
    assert device.calls.count("warm_up") == 4  # each bucket ran once before its capture
    assert generate(engine) == eager_tokens
    # 4 requests: the first step is all prompts (eager), then 9 decode steps of 4 rows: bucket 4.
    assert runner.graphs[4].num_replays == 9 and runner.num_replays == 9
    kv = runner.kv_caches[0]
    assert torch.count_nonzero(kv[:, 0]) == 0  # padding rows never wrote: block 0 stays untouched


def test_three_decodes_pad_to_four_with_inert_rows():
    engine = make_engine(CpuCudaBackend())
    runner = engine.runner
    decodes = SchedulerOutput(tuple(ScheduledRequest(f"d{i}", (7 + i,), 5 + i, (3 + 2 * i, 4 + 2 * i), i != 1)
                                    for i in range(3)))
    assert runner.graph_batch_size(decodes) == 4
    logits, request_ids = runner.execute(decodes)
    assert request_ids == ("d0", "d2") and logits.shape == (2, 512)  # d1 does not sample
    buffers = runner.buffers
    assert buffers.tokens[:, :4].tolist() == [[7, 8, 9, 0], [5, 6, 7, 0], [4 * 4 + 1, 6 * 4 + 2, 8 * 4 + 3, -1]]
    assert buffers.seq_lens[:4].tolist() == [6, 7, 8, 1]
    assert buffers.block_table[:4, :2].tolist() == [[3, 4], [5, 6], [7, 8], [0, 0]]
    assert runner.graphs[4].num_replays == 1
    full = runner.logits[:4]
    assert torch.equal(logits, full[[0, 2]])


def test_prompt_chunks_and_oversized_batches_run_eagerly():
    runner = make_engine(CpuCudaBackend(), max_num_seqs=2).runner
    mixed = SchedulerOutput((ScheduledRequest("d", (7,), 5, (3, 4), True),
                             ScheduledRequest("p", (1, 2, 3), 0, (5,), True)))
    assert runner.graph_batch_size(mixed) is None
    three = SchedulerOutput(tuple(ScheduledRequest(f"d{i}", (7,), 5, (3, 4), True) for i in range(3)))
    assert runner.graph_batch_size(three) is None
    logits, ids = runner.execute(mixed)
    assert ids == ("d", "p") and logits.shape[0] == 2 and runner.num_replays == 0


def test_a_kernel_that_is_not_graph_safe_turns_graphs_off_and_says_why(eager_tokens):
    engine = make_engine(CpuCudaBackend(kernel=ReferenceAttentionKernel))
    assert engine.runner.graphs == {} and "ReferenceAttentionKernel" in engine.runner.disabled_reason
    assert generate(engine) == eager_tokens


def test_graphs_off_by_choice():
    runner = make_engine(CpuCudaBackend(cuda_graphs=False)).runner
    assert runner.graphs == {} and runner.disabled_reason == "disabled by configuration"


def test_graph_sizes_from_the_config_like_tgi_cuda_graphs_flag():
    from dataclasses import replace

    backend = CpuCudaBackend()
    engine = make_engine(backend)
    config = replace(engine.config, graph_batch_sizes=(4, 1, 99))
    runner = backend.make_runner(engine.loaded, engine.runner.kv_caches, config)
    assert runner.sizes == (1, 4)  # sorted, and none past max_num_seqs
    off = backend.make_runner(engine.loaded, engine.runner.kv_caches, replace(config, graph_batch_sizes=()))
    assert off.graphs == {} and off.disabled_reason == "disabled by configuration"


def test_a_one_token_prompt_chunk_that_scores_prompt_logprobs_runs_eagerly():
    runner = make_engine(CpuCudaBackend()).runner
    chunk = ScheduledRequest("p", (7,), 2, (3,), False, computes_prompt_logprobs=True)
    step = SchedulerOutput((ScheduledRequest("d", (5,), 5, (4, 6), True), chunk))
    assert runner.graph_batch_size(step) is None
    runner.execute(step)
    assert set(runner.last_prompt_logits) == {"p"} and runner.num_replays == 0
