import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from switchyard.core.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer():
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_tokenizer

    return load_tokenizer(ModelConfig())
