"""The shipped backend contract suite for XpuBackend on the CPU device (IPEX's paged ops on
host tensors): probe, capabilities, KV layout, the kernel against the reference on ragged
batches (float32 and bfloat16, block sizes 8 and 16, GQA groups 1 and 3), write_kv, greedy
engine output equal to the reference backend's, KV sizing, sharding hooks unsharded."""
from __future__ import annotations

import pytest

from switchyard.backends.xpu.ipex import load as load_ipex  # noqa: E402

try:  # IPEX, fitting this torch: only in the xpu environment (.ci/backend_env.sh xpu)
    load_ipex()
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

from switchyard.backends.xpu import XpuBackend  # noqa: E402
from switchyard.core.testing import BackendContract  # noqa: E402


class TestXpuBackendOnCpu(BackendContract):
    @pytest.fixture
    def backend(self):
        return XpuBackend(device="cpu")
