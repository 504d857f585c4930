"""The OpenAI request -> engine parameters conversion, without a server: every field
the OpenAI SDK sends is declared (so none is silently dropped), and each is either
honoured or rejected with a 400 that names it."""
from __future__ import annotations

import inspect

import pytest
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

from switchyard.gateway.errors import ErrorKind, GatewayError
from switchyard.gateway.openai.messages import template_messages
from switchyard.gateway.openai.params import chat_plan, completion_plan
from switchyard.gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from switchyard.gateway.settings import ServerSettings

SETTINGS = ServerSettings(model_id="m")
VOCAB = 1000
MESSAGES = [{"role": "user", "content": "hi"}]
_SDK_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def _chat(**fields):
    return chat_plan(ChatCompletionRequest(model="m", messages=MESSAGES, **fields), SETTINGS, VOCAB)


def _completion(**fields):
    return completion_plan(CompletionRequest(model="m", prompt="hi", **fields), SETTINGS, VOCAB)


@pytest.mark.parametrize(("sdk_method", "schema"), [(ChatCompletions.create, ChatCompletionRequest),
                                                    (Completions.create, CompletionRequest)])
def test_every_field_the_sdk_sends_is_declared(sdk_method, schema):
    sent = set(inspect.signature(sdk_method).parameters) - _SDK_ONLY
    assert sent - set(schema.model_fields) == set()


def test_chat_fields_map_onto_sampling_params():
    plan = _chat(temperature=0, top_p=1.0, stop="\n", seed=7, n=3, max_tokens=9, max_completion_tokens=5,
                 frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={"12": -100, "13": 5},
                 logprobs=True, top_logprobs=4, top_k=20, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
                 min_tokens=2, skip_special_tokens=False, stop_token_ids=[3], user="u", metadata={"k": "v"},
                 response_format={"type": "text"}, stream_options={"include_usage": True})
    p = plan.params
    assert p.greedy and p.top_p == 1.0 and p.stop == ("\n",) and p.seed == 7
    assert plan.num_choices == plan.num_sequences == 3 and plan.max_tokens == 5  # max_completion_tokens wins
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.5)
    assert p.logit_bias == ((12, -100.0), (13, 5.0))
    assert p.logprobs == 4 and p.top_k == 20 and p.min_p == 0.1 and p.repetition_penalty == 1.2
    assert p.ignore_eos and p.min_tokens == 2 and not p.skip_special_tokens and p.stop_token_ids == (3,)


def test_logprobs_without_top_logprobs_and_defaults():
    assert _chat(logprobs=True).params.logprobs == 0
    assert _chat().params.logprobs is None
    plan = _chat(top_p=0.0)  # a nucleus of probability 0 keeps the top token: greedy
    assert plan.params.greedy
    assert _chat().max_tokens is None and _chat().default_max_tokens is None  # chat: the context left


def test_n_sequences_get_distinct_seeds():
    class Service:
        @staticmethod
        def check_lengths(num_prompt_tokens, max_new_tokens, param):
            return 100 if max_new_tokens is None else max_new_tokens

    params = _chat(n=3, seed=10).sequence_params(Service, 5, "messages")
    seeds = [p.seed for p in params]
    assert seeds[0] == 10 and len(set(seeds)) == 3 and all(p.n == 1 for p in params)
    # a neighbouring request seed shares none of them (seed + i did: 10 with n=3 reused 11's)
    neighbours = {p.seed for s in (9, 11, 12) for p in _chat(n=3, seed=s).sequence_params(Service, 5, "m")}
    assert not neighbours & set(seeds)
    assert [p.seed for p in _chat(n=2).sequence_params(Service, 5, "messages")] == [None, None]
    assert _completion().sequence_params(Service, 5, "prompt")[0].max_tokens == 16  # OpenAI's default


def test_completion_fields():
    plan = _completion(best_of=3, n=2, echo=True, logprobs=2, max_tokens=4)
    assert (plan.num_choices, plan.num_sequences) == (2, 3)
    assert plan.params.logprobs == 2 and plan.params.prompt_logprobs == 2
    assert _completion(best_of=2).params.logprobs == 0  # ranking best_of needs log-probabilities
    scoring = _completion(echo=True, max_tokens=0, logprobs=0)
    assert scoring.discard_output and scoring.params.max_tokens == 1


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5, "min_tokens": 9}, "min_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"seed": 2**64}, "seed"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),  # "high" is refused by a model that does not reason
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"store": True}, "store"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {}}, "moderation"),
    ({"echo": True}, "echo"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_json": {"type": "object", "minProperties": -1}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
])
def test_chat_rejects_what_it_cannot_honour(fields, param):
    with pytest.raises(GatewayError) as caught:
        _chat(**fields)
    assert caught.value.param == param
    assert caught.value.kind in (ErrorKind.VALIDATION, ErrorKind.TOOL)  # both are 400 on /v1


def test_tools_with_tool_choice_none_and_accepted_hints():
    _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="none")
    _chat(service_tier="auto", prediction={"type": "content", "content": "x"}, prompt_cache_key="k",
          safety_identifier="s", parallel_tool_calls=False, reasoning_effort="none", modalities=["text"],
          store=False, stream_options={"include_usage": True, "include_obfuscation": False})


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_completions_reject_what_they_cannot_honour(fields, param):
    with pytest.raises(GatewayError) as caught:
        _completion(**fields)
    assert caught.value.param == param


def test_messages_for_the_template():
    messages = template_messages(ChatCompletionRequest(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "2"}]},
    ]).messages)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "hi", "name": "ann"}
    assert messages[2]["content"] == "" and messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[3] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}


def test_non_text_content_is_rejected_naming_the_message():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(GatewayError) as caught:
        template_messages(request.messages)
    assert caught.value.param == "messages.1.content" and "image_url" in caught.value.message
