"""Shared by the GPU benchmark's sections: logging to stdout and a file, time budgets,
random workloads, the engine driver, and a CPU stand-in for the device (--smoke)."""
from __future__ import annotations

import random
import sys
import time
import traceback
from dataclasses import dataclass

import torch


class Log:
    """Prints every line at once and appends it to a log file."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None
        self._start = time.perf_counter()

    def __call__(self, message: str = "") -> None:
        line = f"[{time.perf_counter() - self._start:7.1f}s] {message}"
        print(line, flush=True)
        if self._file:
            self._file.write(line + "\n")

    def section(self, title: str) -> None:
        self("")
        self("=" * 8 + f" {title} " + "=" * max(0, 70 - len(title)))

    def error(self, what: str, error: BaseException) -> None:
        self(f"!! {what} failed: {type(error).__name__}: {error}")
        for line in traceback.format_exc().rstrip().splitlines()[-12:]:
            self("!!   " + line)


@dataclass
class Deadline:
    """A section's time budget; `left()` is what remains of it (and of the whole run)."""

    end: float

    @classmethod
    def after(cls, seconds: float, hard_end: float | None = None) -> "Deadline":
        end = time.perf_counter() + seconds
        return cls(min(end, hard_end) if hard_end is not None else end)

    def left(self) -> float:
        return self.end - time.perf_counter()

    def passed(self) -> bool:
        return self.left() <= 0


def run_section(log: Log, title: str, body, *args):
    """Runs one section; a failure is logged and the run goes on with the next section."""
    log.section(title)
    try:
        return body(*args)
    except Exception as error:  # noqa: BLE001 - one section's failure must not lose the others
        log.error(title, error)
        return None
    finally:
        sys.stdout.flush()


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """num prompts of uniformly random lengths in [min_len, max_len] and random token ids
    (id 0..255 are byte tokens of the dummy tokenizer; any id works for random weights)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def drive(engine, prompts: list[list[int]], new_tokens: int, deadline: Deadline | None = None,
          prefix: str = "req") -> dict:
    """Greedy generation of new_tokens per prompt (EOS ignored) through EngineCore.step();
    stops early at the deadline (unfinished requests are aborted and not counted)."""
    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import FinishReason, Request

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(Request(request_id, list(prompt), params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    finished, steps, step_times = set(), 0, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if deadline is not None and deadline.passed():
            for request_id in ids:
                if request_id not in finished:
                    engine.finish_request(request_id, FinishReason.ABORT)
            break
        step_start = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
        step_times.append(time.perf_counter() - step_start)
        steps += 1
    elapsed = time.perf_counter() - start
    done = sum(len(tokens[r]) for r in finished)
    return dict(elapsed=elapsed, steps=steps, step_times=step_times, finished=len(finished), output_tokens=done,
                complete=len(finished) == len(ids), token_ids=[tokens[r] for r in ids])


class FakeGraph:
    def __init__(self, run):
        self.run = run

    def replay(self) -> None:
        self.run()


class CpuStandIn:
    """The device calls of backends/cuda/device.py for a CPU smoke run: fixed memory
    readings, and 'graphs' that replay by running what was captured again."""

    pin_memory = False

    def __init__(self, free: int = 2 * 2**30, total: int = 4 * 2**30):
        self.free, self.total = free, total

    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...
    def reset_peak_memory_stats(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 64 * 2**20

    def graph_pool(self) -> object:
        return None

    def warm_up(self, run) -> None:
        run()

    def capture(self, run, pool) -> FakeGraph:
        return FakeGraph(run)


def make_backend(smoke: bool):
    """The real CudaBackend, or (--smoke) the same class on the CPU over CpuStandIn, its
    Triton kernels under the interpreter."""
    from switchyard.backends.cuda import CudaBackend

    if not smoke:
        return CudaBackend()
    backend = CudaBackend(device_ops=CpuStandIn())
    backend._device = torch.device("cpu")
    backend.init_device = lambda shard=None: None  # no device to select, no process group
    return backend


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
