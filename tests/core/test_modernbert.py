"""ModernBERT served for embeddings (core/models/modernbert.py) through the engine (the real CPU
backend), against transformers' ModernBertModel and sentence-transformers on tiny random-weight
models: 4 layers with every third global (layers 0 and 3), a local window of 8 tokens, and prompts
of 3 to 44 tokens, so the window cuts the long ones; mean pooling with the default bias-free
layers, CLS pooling with every bias on and the tanh GELU; a masked-LM checkpoint (`model.` names
and a head) served as found (`--task auto`, its config's classifier_pooling); batches against
prompts alone."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedding_models import TEXTS, assert_close, reference_embeddings, save_sentence_transformer, wordpiece_tokenizer
from model_helpers import randomize
from switchyard.core.llm import LLM
from switchyard.core.models import UnsupportedModelError
from switchyard.core.models.modernbert import GLOBAL, LOCAL, layer_types, rope_settings

LOCAL_ATTENTION = 8
MODELS = {  # name -> (config options, sentence-transformers pooling or None: a masked-LM checkpoint, Normalize)
    "mean": ({}, "mean", True),
    "cls": (dict(attention_bias=True, mlp_bias=True, norm_bias=True, hidden_activation="gelu_pytorch_tanh"),
            "cls", False),
    "mlm": (dict(classifier_pooling="mean"), None, False),
}


def modernbert_config(vocab_size: int, **extra):
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, global_attn_every_n_layers=3, local_attention=LOCAL_ATTENTION,
                            max_position_embeddings=256, pad_token_id=0, cls_token_id=2, bos_token_id=2,
                            sep_token_id=3, eos_token_id=3, **extra)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (path, transformers' ModernBertModel with the same weights, eager attention)."""
    from transformers import AutoModel, ModernBertForMaskedLM

    tokenizer = wordpiece_tokenizer()
    out = {}
    for seed, (name, (options, mode, normalize)) in enumerate(MODELS.items()):
        config = modernbert_config(len(tokenizer), **options)
        path = tmp_path_factory.mktemp(name)
        if mode is None:
            mlm = ModernBertForMaskedLM(config).eval()
            randomize(mlm, seed)
            mlm.save_pretrained(path, safe_serialization=True)
            tokenizer.save_pretrained(path)
        else:
            hf = AutoModel.from_config(config, dtype=torch.float32).eval()
            randomize(hf, seed)
            save_sentence_transformer(path, hf, tokenizer, mode, normalize)
        base = AutoModel.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()
        out[name] = (str(path), base)
    return out


def llm(path: str, **options) -> LLM:
    return LLM(path, backend="cpu", block_size=4, num_kv_blocks=256, max_num_batched_tokens=512, **options)


def transformers_pooled(path: str, base: torch.nn.Module, mode: str, texts=TEXTS) -> np.ndarray:
    """transformers' ModernBertModel on each text alone: the mean of its final states, or the first."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = []
    with torch.no_grad():
        for text in texts:
            states = base(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
            rows.append((states.mean(0) if mode == "mean" else states[0]).numpy())
    return np.stack(rows)


def test_the_tiny_models_have_local_layers_the_long_prompts_outgrow(models):
    from transformers import AutoTokenizer

    path, base = models["mean"]
    assert base.config.layer_types == [GLOBAL, LOCAL, LOCAL, GLOBAL]
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(path)(TEXTS)["input_ids"]]
    assert min(lengths) < LOCAL_ATTENTION // 2 and max(lengths) > 4 * LOCAL_ATTENTION


@pytest.mark.parametrize("name, mode", [("mean", "mean"), ("cls", "cls")])
def test_embeddings_equal_transformers_and_sentence_transformers(models, name, mode):
    path, base = models[name]
    with llm(path) as model:
        info = model.engine.info.pooling
        assert (info.method, info.origin) == (mode, "sentence-transformers config")
        ours = np.array(model.embed(TEXTS))
    assert_close(ours, reference_embeddings(path))
    raw = transformers_pooled(path, base, mode)
    if MODELS[name][2]:  # a Normalize module
        raw = raw / np.linalg.norm(raw, axis=-1, keepdims=True)
    assert_close(ours, raw)


def test_a_batch_gives_each_prompt_what_it_gets_alone(models):
    """Short prompts batched with long ones (padded, the window masked per prompt), in any order."""
    with llm(models["mean"][0]) as model:
        together = np.array(model.embed(TEXTS))
        reversed_ = np.array(model.embed(TEXTS[::-1]))[::-1]
        alone = np.array([model.embed(text)[0] for text in TEXTS])
    assert_close(together, alone, cosine=0.99999, atol=1e-5)
    assert_close(reversed_, alone, cosine=0.99999, atol=1e-5)


def test_a_masked_lm_checkpoint_is_found_to_be_an_encoder_and_pools_as_its_config_hints(models):
    """No sentence-transformers files: `--task auto` embeds, mean-pooled as classifier_pooling says,
    L2-normalised (the default without such files); `model.` names load, the MLM head is ignored;
    `--pooling cls` overrides; `--task generate` is refused."""
    path, base = models["mlm"]
    with llm(path) as model:
        info = model.engine.info.pooling
        assert (info.method, info.origin, info.normalize) == ("mean", "config classifier_pooling", True)
        assert not model.engine.loaded.model.causal
        ours = np.array(model.embed(TEXTS))
    reference = transformers_pooled(path, base, "mean")
    assert_close(ours, reference / np.linalg.norm(reference, axis=-1, keepdims=True))
    with llm(path, pooling="cls") as model:
        cls = np.array(model.embed(TEXTS, normalize=False))
    assert_close(cls, transformers_pooled(path, base, "cls"))
    with pytest.raises(UnsupportedModelError, match="encoder-only"):
        llm(path, task="generate")


def test_older_configs_name_their_rope_thetas_and_global_layers():
    """Configs saved before transformers 5 (answerdotai/ModernBERT-base) have no layer_types or
    rope_parameters."""
    old = SimpleNamespace(num_hidden_layers=7, global_attn_every_n_layers=3, global_rope_theta=160000.0,
                          local_rope_theta=10000.0)
    assert layer_types(old) == [GLOBAL, LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL]
    assert rope_settings(old, GLOBAL) == (160000.0, {"rope_type": "default"})
    assert rope_settings(old, LOCAL) == (10000.0, {"rope_type": "default"})
    new = modernbert_config(100, global_rope_theta=80000.0)
    assert rope_settings(new, GLOBAL) == (80000.0, {"rope_type": "default"})
    assert rope_settings(new, LOCAL)[0] == 10000.0
