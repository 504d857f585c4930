"""Every model class declares the CausalLM contract (core/models/base.py) that the loader, the
runner and the backends call: nothing is looked up with getattr/hasattr."""
from __future__ import annotations

import pytest

from switchyard.core.config import ModelConfig
from switchyard.core.loader import load_model
from switchyard.core.models import GemmaForCausalLM, LlamaForCausalLM, MoeForCausalLM, Phi3ForCausalLM
from switchyard.core.models.base import CausalLM
from switchyard.core.models.transformers_fallback import TransformersForCausalLM
from switchyard.core.testing import ReferenceBackend


@pytest.mark.parametrize("model_class", [LlamaForCausalLM, MoeForCausalLM, Phi3ForCausalLM, GemmaForCausalLM,
                                         TransformersForCausalLM])
def test_every_model_class_implements_the_contract(model_class):
    assert issubclass(model_class, CausalLM) and not model_class.__abstractmethods__


def test_the_loader_fits_the_context_and_names_the_head(monkeypatch):
    fitted = []
    monkeypatch.setattr(LlamaForCausalLM, "fit_context", lambda self, n: fitted.append(n))
    loaded = load_model(ModelConfig(model="llama-tiny", load_format="dummy", max_model_len=64), ReferenceBackend(), 4)
    assert fitted == [64]
    assert loaded.model.output_head() is loaded.model.lm_head
