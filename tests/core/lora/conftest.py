"""Fixtures of the LoRA tests: one torch thread (the kernels' results do not depend on it; the
tests run faster beside others), and one tiny random Llama saved as a checkpoint per module."""
from __future__ import annotations

import pytest
import torch
from lora_helpers import save_base, tiny_llama_config


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, default_tokenizer):
    return save_base(tiny_llama_config(), tmp_path_factory.mktemp("tiny-llama"), default_tokenizer)
