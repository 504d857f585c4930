"""How the Triton kernels' tests run without a GPU: under Triton's interpreter (numpy, one program
at a time). Import this module before anything that imports triton: it sets TRITON_INTERPRET where
there is no CUDA device (triton reads it when a kernel is defined) and skips the importing test
file where triton is not installed.

Triton decides interpreter or compiler when a @jit function is defined; its own library (tl.zeros,
tl.max, ...) is defined when triton is imported. If some module imported triton before
TRITON_INTERPRET was set, kernels cannot run on a CPU in this process: `skip_unless_runnable` then
skips every test but the file's FRESH_PROCESS_TEST, which reruns the file in a new process
(`rerun_in_fresh_process`)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
FRESH_PROCESS_TEST = "test_in_a_fresh_process_if_triton_was_imported_too_early"


def _interpreter_is_whole() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return ON_GPU or isinstance(triton.language.standard.zeros, InterpretedFunction)


RUNS_HERE = _interpreter_is_whole()


def skip_unless_runnable(request) -> None:
    """For an autouse fixture: skips a kernel test that cannot run in this process."""
    if not RUNS_HERE and request.node.originalname != FRESH_PROCESS_TEST:
        pytest.skip("triton was imported without TRITON_INTERPRET; the fresh-process test runs this file")


def rerun_in_fresh_process(path: str) -> None:
    """Runs the test file at `path` in a new process with the interpreter on; asserts it passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
