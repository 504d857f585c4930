"""Embedding models through the engine (the real CPU backend), against sentence-transformers on
the same random-weight models: Qwen3 last-token and Qwen2 mean pooling (chunked and whole),
BERT mean and CLS, XLM-RoBERTa mean, a GGUF embedding file (llama.cpp's pooling_type), Matryoshka
dimensions, normalisation as the model says; and what the engine refuses."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embedding_models import (TEXTS, assert_close, bpe_tokenizer, decoder_config, encoder_config,
                              reference_embeddings, save_embedding_model, save_sentence_transformer,
                              wordpiece_tokenizer)
from gguf_files import write_gguf
from model_helpers import randomize
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.llm import LLM
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.pooling.params import PoolingParams
from switchyard.core.scheduling.request import FinishReason, Request, pooling_request

MODELS = {  # name -> (config maker, tokenizer maker, sentence-transformers pooling, Normalize module)
    "qwen3-last": (lambda n: decoder_config("qwen3", n), bpe_tokenizer, "lasttoken", True),
    "qwen2-mean": (lambda n: decoder_config("qwen2", n), bpe_tokenizer, "mean", True),
    "bert-mean": (lambda n: encoder_config("bert", n), wordpiece_tokenizer, "mean", True),
    "bert-cls": (lambda n: encoder_config("bert", n), wordpiece_tokenizer, "cls", False),
    "xlmr-mean": (lambda n: encoder_config("xlm-roberta", n), wordpiece_tokenizer, "mean", True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name, (config, tokenizer_maker, mode, normalize) in MODELS.items():
        tokenizer = tokenizer_maker()
        paths[name] = save_embedding_model(tmp_path_factory.mktemp(name), config(len(tokenizer)), tokenizer, mode,
                                           normalize)
    return paths


def llm(path: str, budget: int = 2048, **options) -> LLM:
    return LLM(path, backend="cpu", block_size=4, num_kv_blocks=256, max_num_batched_tokens=budget, **options)


def engine_embed(engine: EngineCore, token_lists: list[list[int]], params: PoolingParams = PoolingParams()):
    for i, ids in enumerate(token_lists):
        engine.add_request(pooling_request(f"e{i}", ids, params))
    out = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.finish_reason is FinishReason.POOLED and output.new_token_ids == ()
            out[output.request_id] = np.frombuffer(output.embedding.tobytes(), dtype=np.float32)
    return np.stack([out[f"e{i}"] for i in range(len(token_lists))])


@pytest.mark.parametrize("name, budget", [("qwen3-last", 2048), ("qwen3-last", 5), ("qwen2-mean", 2048),
                                          ("qwen2-mean", 5), ("bert-mean", 2048), ("bert-cls", 2048),
                                          ("xlmr-mean", 2048)])
def test_embeddings_equal_sentence_transformers(models, name, budget):
    """`budget` 5: the decoders' prompts are computed in chunks of at most 5 tokens across steps."""
    path = models[name]
    with llm(path, budget) as model:
        assert model.engine.loaded.pooling is not None and model.engine.info.pooling.origin == \
            "sentence-transformers config"
        ours = np.array(model.embed(TEXTS))
        if budget < 2048:
            assert model.engine.scheduler.config.chunk_prompts
    assert_close(ours, reference_embeddings(path))


def test_an_encoder_computes_each_prompt_whole_and_prepares_no_decode_step(models):
    with llm(models["bert-mean"], budget=64, compile_decode=True) as model:
        config = model.engine.config
        assert not config.scheduler.chunk_prompts and not config.compile_decode
        assert not model.engine.loaded.model.causal
        with pytest.raises(ValidationError, match="computes a prompt in one step, whose token budget is 64"):
            model.engine.add_request(pooling_request("long", [5] * 100, PoolingParams()))
        assert_close(np.array(model.embed(TEXTS)), reference_embeddings(models["bert-mean"]))


def test_a_batch_gives_each_prompt_what_it_gets_alone(models):
    for name in ("qwen2-mean", "bert-mean"):
        with llm(models[name]) as model:
            together = np.array(model.embed(TEXTS))
            alone = np.array([model.embed(text)[0] for text in TEXTS])
        assert_close(together, alone, cosine=0.99999, atol=1e-5)


def test_normalisation_follows_the_model_unless_the_request_says(models):
    """bert-cls has no Normalize module: its embeddings are the raw CLS states, as sentence-transformers
    gives them; normalize=True asks for unit vectors, and normalize=False on a normalising model for raw ones."""
    reference = reference_embeddings(models["bert-cls"])
    with llm(models["bert-cls"]) as model:
        assert not model.engine.info.pooling.normalize
        raw = np.array(model.embed(TEXTS))
        unit = np.array(model.embed(TEXTS, normalize=True))
    assert_close(raw, reference)
    assert np.abs(np.linalg.norm(raw, axis=-1) - 1).max() > 0.1
    assert_close(unit, reference / np.linalg.norm(reference, axis=-1, keepdims=True))
    with llm(models["qwen2-mean"]) as model:
        unnormalised = np.array(model.embed(TEXTS, normalize=False))
    normalised = reference_embeddings(models["qwen2-mean"])
    assert_close(unnormalised / np.linalg.norm(unnormalised, axis=-1, keepdims=True), normalised)
    assert np.abs(np.linalg.norm(unnormalised, axis=-1) - 1).max() > 0.1


def test_matryoshka_dimensions_cut_then_normalise_and_others_are_refused(models, tmp_path):
    path = tmp_path / "matryoshka"
    tokenizer = bpe_tokenizer()
    save_embedding_model(path, decoder_config("qwen3", len(tokenizer), matryoshka_dimensions=[16, 32]), tokenizer,
                         "lasttoken")
    reference = reference_embeddings(path, truncate_dim=16)
    with llm(str(path)) as model:
        assert model.engine.info.pooling.matryoshka_dimensions == (16, 32)
        cut = np.array(model.embed(TEXTS, dimensions=16))
        with pytest.raises(ValidationError, match="one of the sizes this model was trained for: 16, 32"):
            model.embed(TEXTS, dimensions=8)
        assert len(model.embed("a", dimensions=64)[0]) == 64  # the whole size is always allowed
    assert cut.shape == (len(TEXTS), 16)
    assert_close(cut, reference / np.linalg.norm(reference, axis=-1, keepdims=True))
    with llm(models["qwen3-last"]) as model, pytest.raises(ValidationError, match="does not support Matryoshka"):
        model.embed("a", dimensions=16)


@pytest.mark.parametrize("pooling_type, mode", [(3, "lasttoken"), (1, "mean")])
def test_a_gguf_embedding_file_pools_as_its_pooling_type_says(tmp_path, pooling_type, mode):
    """A Qwen2 decoder written as a GGUF with llama.cpp's pooling_type: served for embeddings under
    --task auto, pooled as the file says and normalised (llama.cpp's default), equal to
    sentence-transformers over the same weights."""
    from transformers import Qwen2ForCausalLM

    tokenizer = bpe_tokenizer()
    hf = Qwen2ForCausalLM(decoder_config("qwen2", len(tokenizer))).eval()
    randomize(hf, 5)
    gguf_path = tmp_path / "tiny-embed.gguf"
    write_gguf(hf, str(gguf_path), pooling_type=pooling_type)
    reference = reference_embeddings(save_sentence_transformer(tmp_path / "st", hf.model, tokenizer, mode))
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(gguf_path), cache_dir=""),
                                     cache=CacheConfig(block_size=4, num_blocks=128), backend="cpu"))
    assert engine.info.pooling.origin == "GGUF pooling_type" and engine.info.pooling.normalize
    ours = engine_embed(engine, [tokenizer(text)["input_ids"] for text in TEXTS])
    assert_close(ours, reference)


def test_each_engine_refuses_the_other_kind_of_request(models, tmp_path):
    with llm(models["qwen3-last"]) as model:
        with pytest.raises(ValidationError, match="served for embeddings .* does not generate text"):
            model.engine.add_request(Request("g", [1, 2, 3], SamplingParams()))
    tokenizer = bpe_tokenizer()
    generator = tmp_path / "generator"
    save_embedding_model(generator, decoder_config("qwen3", len(tokenizer), architectures=["Qwen3ForCausalLM"]),
                         tokenizer, pooling_mode=None)
    _as_causal_lm(generator)
    with llm(str(generator)) as model:
        assert model.engine.info.pooling is None  # auto: no sentence-transformers files, no encoder
        with pytest.raises(ValidationError, match="not an embedding model"):
            model.embed("a")
    with llm(str(generator), task="embed") as model:  # the same decoder, served for embeddings
        assert model.engine.info.pooling.method == "last" and model.engine.info.pooling.origin == "decoder default"
        assert len(model.embed("a")[0]) == 64


def test_an_aborted_chunked_request_leaves_no_pooled_state_or_block(models):
    with llm(models["qwen2-mean"], budget=4) as model:
        engine = model.engine
        engine.add_request(pooling_request("p", list(range(3, 30)), PoolingParams()))
        engine.step()
        assert "p" in engine.pooler._partial  # the running mean's sum, between chunks
        engine.finish_request("p", FinishReason.ABORT)
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert not engine.pooler._partial and pool.num_free_blocks == pool.num_usable_blocks


def _as_causal_lm(path) -> None:
    """A bare decoder's directory (Qwen3Model weights) made a causal LM's: `model.` names and a tied head."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    save_file({f"model.{name}": tensor for name, tensor in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))


def test_the_pooler_folds_chunks_and_starts_over_on_a_recompute():
    """Mean pooling over two chunks equals the mean of all the states; a chunk at position 0 (a
    recompute after preemption) drops what was folded before; CLS keeps the first state."""
    from switchyard.core.pooling.pooler import Pooler
    from switchyard.core.pooling.spec import PoolingSpec
    from switchyard.core.scheduling.output import ScheduledRequest

    states = torch.randn(10, 8)
    request = pooling_request("r", list(range(10)), PoolingParams(normalize=False))
    lookup = {"r": request}.get

    def chunk(start, stop):
        return (ScheduledRequest("r", tuple(range(start, stop)), start, (1, 2, 3), samples=False, pools=True),)

    for method, expected in (("mean", states.mean(0)), ("cls", states[0]), ("last", states[-1])):
        pooler = Pooler(PoolingSpec(method, normalize=True, size=8))
        assert pooler.step(chunk(0, 4), {"r": states[:4] + 100}, lookup) == []  # to be dropped: recomputed below
        assert pooler.step(chunk(0, 6), {"r": states[:6]}, lookup) == []
        [output] = pooler.step(chunk(6, 10), {"r": states[6:]}, lookup)
        assert output.finish_reason is FinishReason.POOLED
        torch.testing.assert_close(torch.tensor(output.embedding.tolist()), expected)
        assert not pooler._partial
