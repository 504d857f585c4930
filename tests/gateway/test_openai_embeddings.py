"""POST /v1/embeddings and TEI's /embed, driven by the clients people use (the OpenAI SDK, whose
default is base64; LangChain's OpenAIEmbeddings, whose default sends token ids; LlamaIndex's
OpenAILikeEmbedding), against sentence-transformers on the served model: a tiny random Qwen3
decoder with the default model's tokenizer, sentence-transformers' last-token pooling and
Normalize, and Matryoshka dimensions. Errors in each dialect's shape; generation and embedding
models refuse each other's routes."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from served_engine import start_engine, stop_engine
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.testing.serving import free_port

NAME = "tiny-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Embeddings map text to vectors.", "a"]
MAX_POSITIONS = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_tokenizer):
    """Qwen3-Embedding's shape, tiny and random, saved through sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(7)
    config = Qwen3Config(vocab_size=len(default_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=MAX_POSITIONS, is_matryoshka=True)
    path = tmp_path_factory.mktemp("tiny-embed")
    Qwen3Model(config).save_pretrained(path, safe_serialization=True)
    tokenizer = default_tokenizer.__class__.from_pretrained(default_tokenizer.name_or_path)
    tokenizer.chat_template = None  # sentence-transformers would render each text as a chat message
    tokenizer.save_pretrained(path)
    st = SentenceTransformer(modules=[Transformer(str(path)), Pooling(64, pooling_mode="lasttoken"), Normalize()],
                             device="cpu")
    st.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    return lambda texts, **options: model.encode(list(texts), convert_to_numpy=True, **options)


@pytest.fixture(scope="module")
def embed_server(start_server, model_dir):
    client = start_engine(EngineConfig(model=ModelConfig(model=model_dir), cache=CacheConfig(num_blocks=257),
                                       scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64),
                                       compile_decode=True))
    yield start_server(client=client, model_id=NAME)
    stop_engine(client)


@pytest.fixture(scope="module")
def sdk(embed_server):
    return openai.OpenAI(base_url=embed_server.openai_url, api_key="unused", max_retries=0)


def close(ours, reference, atol=1e-4):
    ours, reference = np.asarray(ours, dtype=np.float32), np.asarray(reference, dtype=np.float32)
    assert ours.shape == reference.shape
    cosine = (ours * reference).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert cosine.min() > 0.9999 and np.abs(ours - reference).max() < atol, (cosine, np.abs(ours - reference).max())


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_the_sdk_default_base64_and_float_equal_sentence_transformers(sdk, embed_server, reference):
    as_base64 = sdk.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    as_float = sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    close(vectors(as_base64), reference(TEXTS))
    assert np.array_equal(vectors(as_base64), vectors(as_float))
    tokenizer = embed_server.client.tokenizer
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert as_float.model == NAME and as_float.object == "list"
    assert [(d.index, d.object) for d in as_float.data] == [(i, "embedding") for i in range(len(TEXTS))]
    raw = httpx.post(embed_server.openai_url + "/embeddings", json={"input": "a", "encoding_format": "base64"})
    assert isinstance(raw.json()["data"][0]["embedding"], str)
    single = sdk.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    close(vectors(single), reference(TEXTS[1:2]))
    embed_server.wait_idle()  # every pooling request ended and gave its blocks back


def test_token_arrays_embed_as_their_text(sdk, embed_server):
    ids = [embed_server.client.tokenizer.encode(t) for t in TEXTS]
    by_text = vectors(sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float"))
    by_ids = vectors(sdk.embeddings.create(model=NAME, input=ids, encoding_format="float"))
    one = vectors(sdk.embeddings.create(model=NAME, input=ids[1], encoding_format="float"))
    close(by_ids, by_text, atol=1e-5)
    close(one, by_text[1:2], atol=1e-5)


def test_matryoshka_dimensions_are_cut_and_normalised_again(sdk, reference):
    response = sdk.embeddings.create(model=NAME, input=TEXTS, dimensions=16)
    cut = vectors(response)
    assert cut.shape == (len(TEXTS), 16)
    expected = reference(TEXTS, truncate_dim=16)
    close(cut, expected / np.linalg.norm(expected, axis=-1, keepdims=True))


def test_truncate_prompt_tokens_keeps_the_last_tokens(sdk, embed_server):
    ids = embed_server.client.tokenizer.encode(" ".join(["word"] * (MAX_POSITIONS + 40)))
    assert len(ids) > MAX_POSITIONS
    cut = vectors(sdk.embeddings.create(model=NAME, input=[ids], encoding_format="float",
                                        extra_body={"truncate_prompt_tokens": 10}))
    close(cut, vectors(sdk.embeddings.create(model=NAME, input=[ids[-10:]], encoding_format="float")), atol=1e-5)
    whole = sdk.embeddings.create(model=NAME, input=[ids], extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_POSITIONS


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "input must not be empty"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ["a", ""]}, "input.1", "input.1 must not be empty"),
    ({"input": [[]]}, "input", "input must not be empty"),
    ({"input": "word " * (MAX_POSITIONS + 10)}, "input", f"more than this model's limit of {MAX_POSITIONS} tokens"),
    ({"input": [1, 10 ** 7]}, "input", "token id 10000000 is outside the vocabulary"),
    ({"input": "a", "dimensions": 65}, "dimensions", "exceeds the model's embedding size (64)"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": {"text": "a"}}, "input", "input must be a string, a list of strings"),
    ({"input": ["a"] * 2049}, "input", "at most 2048 inputs per request"),
])
def test_bad_requests_are_400s_in_openai_shape(embed_server, body, param, words):
    response = httpx.post(embed_server.openai_url + "/embeddings", json={"model": NAME, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_a_model_that_is_not_served_is_a_404(sdk):
    with pytest.raises(openai.NotFoundError, match="The model `text-embedding-3-small` does not exist"):
        sdk.embeddings.create(model="text-embedding-3-small", input="a")


def test_a_generation_model_refuses_embeddings_and_an_embedding_model_refuses_generation(server, sdk):
    generator = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="is not an embedding model") as error:
        generator.embeddings.create(model="default", input="hello")
    assert error.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="served for embeddings .* does not generate text"):
        sdk.completions.create(model=NAME, prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="served for embeddings"):
        sdk.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_concurrent_requests_are_batched_and_each_gets_its_own(embed_server, sdk):
    expected = vectors(sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float"))

    async def run():
        client = openai.AsyncOpenAI(base_url=embed_server.openai_url, api_key="unused", max_retries=0)
        responses = await asyncio.gather(*(client.embeddings.create(model=NAME, input=TEXTS[i % len(TEXTS)])
                                           for i in range(16)))
        await client.close()
        return responses

    for i, response in enumerate(asyncio.run(run())):
        close(vectors(response), expected[i % len(TEXTS)][None], atol=1e-5)
    embed_server.wait_idle()


def test_langchain_openai_embeddings_with_texts_and_with_its_default_token_ids(sdk, embed_server, monkeypatch):
    """check_embedding_ctx_length=False sends the texts; the default tokenizes them with tiktoken's
    cl100k_base and sends the ids, which the server takes as ids of its own vocabulary (as vLLM does),
    so an embedding model served for LangChain's default wants check_embedding_ctx_length=False.
    tiktoken's table comes from llama-index-core's bundled cache (nothing is downloaded)."""
    from langchain_openai import OpenAIEmbeddings

    expected = vectors(sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float"))
    texts = OpenAIEmbeddings(model=NAME, base_url=embed_server.openai_url, api_key="unused",
                             check_embedding_ctx_length=False)
    close(texts.embed_documents(TEXTS), expected, atol=1e-5)
    close([texts.embed_query(TEXTS[0])], expected[:1], atol=1e-5)

    import llama_index.core
    import tiktoken

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", os.path.join(os.path.dirname(llama_index.core.__file__), "_static",
                                                          "tiktoken_cache"))
    ids = [tiktoken.get_encoding("cl100k_base").encode(t) for t in TEXTS]
    assert max(max(i) for i in ids) < len(embed_server.client.tokenizer)
    default = OpenAIEmbeddings(model=NAME, base_url=embed_server.openai_url, api_key="unused")
    close(default.embed_documents(TEXTS),
          vectors(sdk.embeddings.create(model=NAME, input=ids, encoding_format="float")), atol=1e-5)


def test_llama_index_openai_like_embedding(sdk, embed_server):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    expected = vectors(sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float"))
    embedding = OpenAILikeEmbedding(model_name=NAME, api_base=embed_server.openai_url, api_key="unused",
                                    embed_batch_size=3)
    close(embedding.get_text_embedding_batch(TEXTS), expected, atol=1e-5)
    close([embedding.get_query_embedding(TEXTS[2])], expected[2:3], atol=1e-5)


def test_tei_embed_route(embed_server, sdk):
    expected = vectors(sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float"))
    many = httpx.post(embed_server.base_url + "/embed", json={"inputs": TEXTS}, timeout=60)
    assert many.status_code == 200
    close(many.json(), expected, atol=1e-5)
    one = httpx.post(embed_server.base_url + "/embed", json={"inputs": TEXTS[0], "normalize": False}).json()
    raw = np.array(one[0])
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    close([raw / np.linalg.norm(raw)], expected[:1], atol=1e-5)
    long = " ".join(["word"] * (MAX_POSITIONS + 40))
    assert httpx.get(embed_server.base_url + "/info").json()["model_pipeline_tag"] == "feature-extraction"
    refused = httpx.post(embed_server.base_url + "/embed", json={"inputs": long})
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    head = httpx.post(embed_server.base_url + "/embed", json={"inputs": long, "truncate": True}).json()
    ids = embed_server.client.tokenizer.encode(long)[:MAX_POSITIONS]
    close(head, vectors(sdk.embeddings.create(model=NAME, input=[ids], encoding_format="float")), atol=1e-5)


@pytest.mark.slow
def test_switchyard_serve_task_embed_serves_the_default_gguf_for_embeddings():
    """The flags end to end, in the engine's own process: `--task embed` on the default model's GGUF
    (a decoder: last-token pooling, normalised), both embedding routes, generation refused."""
    with httpx.Client() as probe:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1",
                                 "--port", str(port), "--task", "embed", "--max-batch-total-tokens", "4096"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, probe, url)
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            response = client.embeddings.create(model="default", input=["hello world", "goodbye"])
            found = vectors(response)
            assert found.shape == (2, 576) and np.allclose(np.linalg.norm(found, axis=-1), 1, atol=1e-4)
            tei = probe.post(url + "/embed", json={"inputs": "hello world"}, timeout=60).json()
            close(tei, found[:1], atol=1e-5)
            with pytest.raises(openai.BadRequestError, match="served for embeddings"):
                client.completions.create(model="default", prompt="hello", max_tokens=2)
        finally:
            proc.terminate()
            output = proc.communicate(timeout=60)[0]
    assert "LlamaEmbeddingModel), embeddings of 576 dimensions (last-token pooling" in output


def _wait_healthy(proc, probe: httpx.Client, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if probe.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def test_task_and_pooling_flags_reach_the_engine_config_and_a_models_file_sets_them_per_model(tmp_path):
    from switchyard.core.config import EngineConfig
    from switchyard.core.params import ValidationError
    from switchyard.gateway.cli import build_parser
    from switchyard.gateway.models_registry import model_specs
    from switchyard.gateway.serve import engine_config

    parser = build_parser({})
    config = engine_config(parser.parse_args(["serve", "--task", "embed", "--pooling", "mean"]))
    assert (config.model.task, config.model.pooling) == ("embed", "mean")
    assert (engine_config(parser.parse_args(["serve"])).model.task, config.model.pooling) == ("auto", "mean")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--task", "pool"])
    models = tmp_path / "models.yaml"
    models.write_text("- name: chat\n- name: embed\n  task: embed\n  pooling: cls\n")
    chat, embed = model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "chat")
    assert (chat.config.model.task, chat.config.model.pooling) == ("auto", None)
    assert (embed.config.model.task, embed.config.model.pooling) == ("embed", "cls")
    models.write_text("- name: x\n  task: rank\n")
    with pytest.raises(ValidationError, match="task 'rank'"):
        model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
