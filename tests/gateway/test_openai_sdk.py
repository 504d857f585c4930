"""The OpenAI dialect driven by the real `openai` SDK (sync and async) against the
real server, compared with what the engine answers directly."""
from __future__ import annotations

import asyncio
import math

import openai
import pytest
from openai_reference import MODEL_NAME, generate, greedy_chat, greedy_completion

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected_chat(server):
    return greedy_chat(server, MESSAGES, max_tokens=8)


def test_chat_greedy_equals_the_engine_with_and_without_stream(client, expected_chat):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected_chat.text
    assert choice.finish_reason == expected_chat.finish_reason
    assert response.id.startswith("chatcmpl-") and len(response.id) > 12
    assert response.object == "chat.completion" and isinstance(response.created, int) and response.created > 0
    assert response.model == MODEL_NAME and response.system_fingerprint
    assert response._request_id == response.id  # the SDK reads x-request-id
    assert response.usage.prompt_tokens == len(expected_chat.prompt_ids)
    assert response.usage.completion_tokens == len(expected_chat.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != response.id
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected_chat.finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected_chat.token_ids)
    assert usage_chunk.usage.prompt_tokens == len(expected_chat.prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client, expected_chat):
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8,
                                                 temperature=0, stream=True))
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_chat.text


@pytest.mark.slow
def test_async_client_n_choices_with_a_seed_differ_and_repeat(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Write a word."}], n=3, seed=1234,
                      temperature=1.0, max_tokens=6, logprobs=True)
        first, again = await asyncio.gather(client.chat.completions.create(**kwargs),
                                            client.chat.completions.create(**kwargs))
        stream = await client.chat.completions.create(**kwargs, stream=True)
        streamed = {i: "" for i in range(3)}
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        await client.close()
        return first, again, streamed

    first, again, streamed = asyncio.run(run())
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts  # seed + i per choice: the samples differ
    assert [c.message.content for c in again.choices] == texts  # and are reproducible
    assert [streamed[i] for i in range(3)] == texts
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens < first.usage.total_tokens
    assert first.id != again.id


def test_chat_logprobs_are_finite_consistent_and_equal_in_stream(client, expected_chat):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3)
    entries = response.choices[0].logprobs.content
    assert len(entries) == len(expected_chat.token_ids) == response.usage.completion_tokens
    for entry in entries:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the most likely
        assert entry.top_logprobs[0].token == entry.token
        assert all(math.isfinite(t.logprob) for t in entry.top_logprobs)
    assert bytes(b for e in entries for b in e.bytes).decode() == response.choices[0].message.content

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]

    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0,
                                           logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_stop_as_string_or_list_trims_and_reports_stop(client):
    messages = [{"role": "user", "content": "Count from 1 to 10 separated by commas."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    for stop_value in (stop, [stop, "never-there"]):
        stopped = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stop=stop_value)
        assert stopped.choices[0].message.content == text[:text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_logit_bias_and_vllm_extras_are_honoured(client, server, expected_chat):
    first = expected_chat.token_ids[0]
    biased = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0,
                                            logit_bias={str(first): -100}, logprobs=True)
    assert biased.choices[0].logprobs.content[0].token != server.client.tokenizer.decode([first])

    top_k_1 = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.5,
                                             extra_body={"top_k": 1})
    assert top_k_1.choices[0].message.content == expected_chat.text  # top_k 1 is greedy whatever the temperature

    short = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    free = client.chat.completions.create(model=MODEL_NAME, messages=short, max_tokens=12, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 8
    forced = client.chat.completions.create(model=MODEL_NAME, messages=short, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True, "min_p": 0.05,
                                                        "repetition_penalty": 1.1})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 12
    special = client.chat.completions.create(model=MODEL_NAME, messages=short,
                                             max_tokens=free.usage.completion_tokens + 1, temperature=0,
                                             extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert special.choices[0].message.content.startswith(free.choices[0].message.content + "<|im_end|>")
    at_least = client.chat.completions.create(model=MODEL_NAME, messages=short, max_tokens=12, temperature=0,
                                              extra_body={"min_tokens": free.usage.completion_tokens + 2})
    assert at_least.usage.completion_tokens >= free.usage.completion_tokens + 2


def test_content_parts_developer_role_and_accepted_fields(client, expected_chat):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "You are terse."}]},
                {"role": "user", "content": [{"type": "text", "text": "Name three "},
                                             {"type": "text", "text": "colours."}]}]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, top_p=1.0, user="u-1",
        metadata={"team": "a"}, seed=3, frequency_penalty=0.0, presence_penalty=0.0, service_tier="auto",
        response_format={"type": "text"}, parallel_tool_calls=False, store=False,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="none")
    assert response.choices[0].message.content == expected_chat.text  # developer == system here
    assert response.service_tier == "default"


def test_completions_prompt_forms_match_the_engine(client, server):
    expected = greedy_completion(server, "The capital of France is", 6)
    other = greedy_completion(server, "Once upon a time", 6)
    single = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                       temperature=0)
    assert single.choices[0].text == expected.text and single.id.startswith("cmpl-")
    assert single.object == "text_completion" and single.system_fingerprint
    assert single.usage.prompt_tokens == len(expected.prompt_ids)
    assert single.usage.completion_tokens == len(expected.token_ids)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=expected.prompt_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected.text
    both = client.completions.create(model=MODEL_NAME, prompt=["The capital of France is", "Once upon a time"],
                                     max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in both.choices] == [(0, expected.text), (1, other.text)]
    assert both.usage.prompt_tokens == len(expected.prompt_ids) + len(other.prompt_ids)
    ids_list = client.completions.create(model=MODEL_NAME, prompt=[expected.prompt_ids, other.prompt_ids],
                                         max_tokens=6, temperature=0)
    assert [c.text for c in ids_list.choices] == [expected.text, other.text]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == len(expected.token_ids)


def test_completions_echo_and_logprobs(client, server):
    prompt = "The capital of France is"
    expected = greedy_completion(server, prompt, 4)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         logprobs=2)
    choice = response.choices[0]
    assert choice.text == prompt + expected.text
    lp = choice.logprobs
    num_prompt = len(expected.prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + len(expected.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(math.isfinite(x) for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(lp.tokens) - 1))
    for token, logprob, top in zip(lp.tokens[num_prompt:], lp.token_logprobs[num_prompt:],
                                   lp.top_logprobs[num_prompt:]):
        assert len(top) <= 2 and max(top.values()) >= logprob - 1e-6 and top.get(token) == pytest.approx(logprob)

    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:num_prompt])

    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == prompt + expected.text


def test_completions_best_of_returns_the_most_likely(client):
    kwargs = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=5, temperature=1.0, seed=42)
    all_three = client.completions.create(**kwargs, n=3, logprobs=0)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in all_three.choices}
    best = client.completions.create(**kwargs, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(totals, key=totals.get)


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_seeded_sampling_is_reproducible_and_matches_the_engine(client, server):
    prompt = "Tell me a fact:"
    expected = generate(server, server.client.tokenizer.encode(prompt), temperature=0.8, top_p=0.9, seed=99,
                        max_tokens=6)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.8, top_p=0.9, seed=99,
                                         max_tokens=6)
    assert response.choices[0].text == expected.text
