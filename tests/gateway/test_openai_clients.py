"""The OpenAI dialect driven by the client libraries people use with it:
huggingface_hub's InferenceClient, LangChain's ChatOpenAI and LlamaIndex's
OpenAILike, each checked against what the engine answers directly."""
from __future__ import annotations

import asyncio

import pytest
from openai_reference import MODEL_NAME, greedy_chat, greedy_completion

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def expected(server):
    return greedy_chat(server, MESSAGES, MAX_TOKENS)


def test_huggingface_hub_chat_completion(server, expected):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.base_url)
    response = client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.id.startswith("chatcmpl-") and response.model == MODEL_NAME
    chunks = list(client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    via_alias = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=True, top_logprobs=2)
    assert [e.token for e in via_alias.choices[0].logprobs.content] == \
        [server.client.tokenizer.decode([t]) for t in expected.token_ids]


@pytest.mark.slow
def test_langchain_chat_openai_invoke_stream_batch(server, expected):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=server.openai_url, api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0)
    message = llm.invoke(QUESTION)
    assert message.content == expected.text
    assert message.usage_metadata["output_tokens"] == len(expected.token_ids)
    assert message.response_metadata["finish_reason"] == expected.finish_reason
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == expected.text
    other = greedy_chat(server, [{"role": "user", "content": "Name a fruit."}], MAX_TOKENS)
    answers = llm.batch([QUESTION, "Name a fruit."])
    assert [a.content for a in answers] == [expected.text, other.text]

    counted = ChatOpenAI(model=MODEL_NAME, base_url=server.openai_url, api_key="unused", temperature=0,
                         max_tokens=MAX_TOKENS, max_retries=0, stream_usage=True)
    total = None
    for chunk in counted.stream(QUESTION):
        total = chunk if total is None else total + chunk
    assert total.content == expected.text
    assert total.usage_metadata["output_tokens"] == len(expected.token_ids)
    assert total.usage_metadata["input_tokens"] == len(expected.prompt_ids)


def test_langchain_async_and_n(server, expected):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=server.openai_url, api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0)
    sampling = ChatOpenAI(model=MODEL_NAME, base_url=server.openai_url, api_key="unused", temperature=1.0,
                          max_tokens=MAX_TOKENS, max_retries=0, n=2, seed=5)

    async def run():  # one event loop: langchain-openai shares its async HTTP client
        return await llm.ainvoke(QUESTION), await sampling.agenerate([[HumanMessage("Write a word.")]])

    answer, result = asyncio.run(run())
    assert answer.content == expected.text
    texts = [g.text for g in result.generations[0]]
    assert len(texts) == 2 and texts[0] != texts[1]  # seed + i per choice


@pytest.mark.slow
def test_llamaindex_openai_like_complete_chat_stream(server, expected):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    prompt = "The capital of France is"
    completion = greedy_completion(server, prompt, MAX_TOKENS)
    text_llm = OpenAILike(model=MODEL_NAME, api_base=server.openai_url, api_key="unused", temperature=0.0,
                          max_tokens=MAX_TOKENS, max_retries=0, is_chat_model=False)
    assert text_llm.complete(prompt).text == completion.text
    assert "".join(r.delta for r in text_llm.stream_complete(prompt)) == completion.text

    chat_llm = OpenAILike(model=MODEL_NAME, api_base=server.openai_url, api_key="unused", temperature=0.0,
                          max_tokens=MAX_TOKENS, max_retries=0, is_chat_model=True)
    reply = chat_llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert reply.message.content == expected.text
    streamed = "".join(r.delta or "" for r in chat_llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert streamed == expected.text
    assert chat_llm.complete(QUESTION).text == expected.text  # a chat model completes through chat

    # a completion model chats through /v1/completions with its prompt format
    assert text_llm.chat([ChatMessage(role="user", content=QUESTION)]).message.content
