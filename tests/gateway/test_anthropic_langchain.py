"""An agent framework over /v1/messages: LangChain's ChatAnthropic (langchain-anthropic) pointed at
the server with base_url, as users point it at a local model. A plain answer whole and streamed
(equal, and equal to the anthropic SDK's), and an agent's tool loop: a forced call to a LangChain
tool, the tool run by LangChain, its result sent back as a ToolMessage, and a final answer."""
from __future__ import annotations

import anthropic
import pytest
from openai_reference import MODEL_NAME

langchain_anthropic = pytest.importorskip("langchain_anthropic")

from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

QUESTION = "Name three colours."


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


@pytest.fixture(scope="module")
def llm(server):
    return langchain_anthropic.ChatAnthropic(model=MODEL_NAME, base_url=server.base_url, api_key="unused",
                                             max_tokens=16, temperature=0, max_retries=0)


def test_invoke_and_stream_agree_with_the_sdk(server, llm):
    sdk = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    expected = sdk.messages.create(model=MODEL_NAME, max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                                   extra_body={"temperature": 0}).content[0].text
    whole = llm.invoke([HumanMessage(QUESTION)])
    assert whole.content == expected and whole.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream([HumanMessage(QUESTION)]))
    assert streamed == expected


def test_a_tool_loop(llm):
    agent = llm.bind_tools([get_weather], tool_choice="get_weather")
    history = [HumanMessage("What is the weather in Paris?")]
    call_message = agent.invoke(history)
    (call,) = call_message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and call["id"].startswith("toolu_")
    result = get_weather.invoke(call["args"])
    history += [call_message, ToolMessage(result, tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)  # tool_choice auto: the model may answer in text
    assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert answer.content or answer.tool_calls
