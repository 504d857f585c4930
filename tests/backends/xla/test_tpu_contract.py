"""The shipped backend contract suite for TpuBackend on PJRT's CPU device."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

from switchyard.backends.tpu import TpuBackend  # noqa: E402
from switchyard.core.testing import BackendContract  # noqa: E402


class TestTpuBackendOnPjrtCpu(BackendContract):
    gqa_groups = (1, 3)

    @pytest.fixture
    def backend(self):
        return TpuBackend()
