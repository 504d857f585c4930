"""Time per decode step spent in shard communication, at 1, 2 and 3 shards on CPU.

    python benchmarks/shard_comm.py [--shards 1 2 3] [--concurrency 1 8] [--steps 16]

A tiny random Llama (12 heads / 6 KV heads, so 1, 2 and 3 shards all divide it) runs
decode steps through the real engine; on rank 0 (this process) the step broadcast
(core/shard_worker.broadcast_object) and the model's collectives (TorchCommunicator) are
timed. Then two ways of sending a c=32 decode step to the shards are compared: torch's
broadcast_object_list (pickle, then two broadcasts) and core/shards/distributed.py broadcast_object
(the pickle in one fixed-size buffer).
Figures from a shared 2-core machine are an overhead, not a speed-up.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from switchyard.core import LLM, SamplingParams
from switchyard.core.shards import distributed
from switchyard.core.engine import shard_worker
from switchyard.core.backend import ShardInfo
from switchyard.core.scheduling.request import Request
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput
from switchyard.core.shards.group import ProcessShardLauncher

class CommTimer:
    """Wraps the communication entry points of rank 0 and adds up their wall time."""

    def __init__(self):
        self.seconds = 0.0
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def make_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(ModelConfig()).save_pretrained(path)


def decode_steps(model_dir: str, shards: int, concurrency: int, steps: int) -> tuple[float, float]:
    """(median step ms, median communication ms) over decode-only steps."""
    llm = LLM(model_dir, backend="cpu", tensor_parallel_size=shards, num_kv_blocks=512)
    timer = CommTimer()
    timer.wrap(shard_worker, "broadcast_object")
    for name in ("all_reduce", "all_gather", "broadcast"):
        timer.wrap(distributed.TorchCommunicator, name)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    engine, step_ms, comm_ms = llm.engine, [], []
    try:
        for i in range(concurrency):
            engine.add_request(Request(f"b{i}", [1, 2 + i, 3, 4, 5, 6, 7, 8], params))
        engine.step()  # the prefills
        while engine.has_unfinished_requests():
            timer.seconds, start = 0.0, time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - start) * 1e3)
            comm_ms.append(timer.seconds * 1e3)
    finally:
        timer.restore()
        llm.shutdown()
    return statistics.median(step_ms), statistics.median(comm_ms)


def c32_step() -> SchedulerOutput:
    return SchedulerOutput(tuple(ScheduledRequest(f"chatcmpl-{i:032x}", (1000 + i,), 300 + i,
                                                  tuple(range(i * 20, i * 20 + 20)), True)
                                 for i in range(32)))


def _receive(shard: ShardInfo, rounds: int) -> None:
    distributed.init_process_group(shard, "gloo")
    for _ in range(rounds):
        torch.distributed.broadcast_object_list([None], 0, group=distributed.control_group())
    for _ in range(rounds):
        distributed.broadcast_object()


def compare_encodings(rounds: int = 200) -> tuple[float, float, int]:
    """(ms per torch broadcast_object_list, ms per core/shards/distributed.py broadcast_object,
    pickled bytes) of a c=32 decode step."""
    port = shard_worker.free_port("127.0.0.1")
    shards = [ShardInfo(r, 2, r, "127.0.0.1", port, 2) for r in range(2)]
    group = ProcessShardLauncher().start(shards[1:], _receive, (rounds,))
    distributed.init_process_group(shards[0], "gloo")
    step = c32_step()
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            torch.distributed.broadcast_object_list([step], 0, group=distributed.control_group())
        objects = (time.perf_counter() - start) / rounds * 1e3
        start = time.perf_counter()
        for _ in range(rounds):
            distributed.broadcast_object(step)
        one_buffer = (time.perf_counter() - start) / rounds * 1e3
        group.wait(60)
    finally:
        group.stop()
        distributed.destroy_process_group()
    return objects, one_buffer, len(pickle.dumps(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        make_model(model_dir)
        print("shards  c  step_ms  comm_ms  comm_share")
        for shards in args.shards:
            for c in args.concurrency:
                step, comm = decode_steps(model_dir, shards, c, args.steps)
                print(f"{shards:>6} {c:>2} {step:8.2f} {comm:8.2f} {comm / step:10.1%}", flush=True)
    objects, one_buffer, size = compare_encodings()
    print(f"c=32 step ({size} bytes pickled): torch broadcast_object_list {objects:.3f} ms, "
          f"broadcast_object (one {distributed.OBJECT_BUFFER_BYTES >> 10} KiB buffer) {one_buffer:.3f} ms")


if __name__ == "__main__":
    main()
