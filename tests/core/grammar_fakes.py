"""A portable fake grammar compiler: it crosses into a real compile worker process
(core/grammar/worker.py) without a tokenizer, so the workers' life can be tested in seconds.
The worker imports it by name: a test puts this folder on the workers' PYTHONPATH."""
from __future__ import annotations

import time

from switchyard.core.grammar.base import CompiledGrammar, GrammarCompiler


class EchoCompiled(CompiledGrammar):
    def __init__(self, value: str):
        self.value = value

    def new_matcher(self, max_rollback_tokens: int = 0):
        raise NotImplementedError


class EchoCompiler(GrammarCompiler):
    """A regex "sleep:S" compiles in S seconds without using the CPU, "omp" runs one OpenMP
    operation first; anything else compiles at once, to itself."""

    name = "echo"
    portable = True

    def compile(self, spec):
        if spec.value.startswith("sleep:"):
            time.sleep(float(spec.value.split(":", 1)[1]))
        if spec.value == "omp":
            import torch

            torch.ones(64, 64).matmul(torch.ones(64, 64))
        return EchoCompiled(spec.value)

    def dump(self, compiled: EchoCompiled) -> bytes:
        return compiled.value.encode()

    def load(self, data: bytes) -> EchoCompiled:
        return EchoCompiled(data.decode())
