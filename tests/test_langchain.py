"""LangChain as a judge: ``langchain-openai``'s ``ChatOpenAI(use_responses_api=True)`` against the gateway —
text, a streamed answer, and a tool call bound with ``bind_tools``, over two turns.

The upstream is SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py), with vLLM's extra usage arrays.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.support import running_gateway
from tests.vllm_frames import VllmStream

VLLM_USAGE = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0, "input_tokens_per_turn": []},
              "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0, "output_tokens_per_turn": []},
              "total_tokens": 17}


@tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return f"Sunny in {city}."


class Upstream:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        s = VllmStream(response_id=f"resp_{len(self.bodies):016x}").start()
        last = body["input"][-1] if isinstance(body["input"], list) else {}
        if body.get("tools") and last.get("type") != "function_call_output":
            s.call(f"fc_{len(self.bodies):016x}", "call_lc1", "get_weather", [json.dumps({"city": "Paris"})])
        else:
            s.message(f"msg_{len(self.bodies):016x}", ["It is ", "sunny."])
        s.complete()
        if not body.get("stream"):
            resp = json.loads(s.nonstream_body())
            resp["usage"] = VLLM_USAGE
            return httpx.Response(200, json=resp)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=s.body())


def test_langchain_responses_api_text_stream_and_tool_loop() -> None:
    up = Upstream()
    with running_gateway(transport=httpx.MockTransport(up)) as url:
        llm = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="x", use_responses_api=True, max_retries=0)
        answer = llm.invoke("How is the weather?")
        assert answer.text == "It is sunny."
        assert answer.usage_metadata is not None and answer.usage_metadata["total_tokens"] == 17
        streamed = "".join(chunk.text for chunk in llm.stream("How is the weather?"))
        assert streamed == "It is sunny."
        with_tools = llm.bind_tools([get_weather])
        first = with_tools.invoke([HumanMessage("Weather in Paris?")])
        [call] = first.tool_calls
        assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
        result = get_weather.invoke(call["args"])
        final = with_tools.invoke([HumanMessage("Weather in Paris?"), first,
                                   ToolMessage(result, tool_call_id=call["id"])])
    assert final.text == "It is sunny."
    sent = up.bodies[-1]["input"]
    assert sent[-2]["type"] == "function_call" and sent[-1] == {
        "type": "function_call_output", "call_id": "call_lc1", "output": "Sunny in Paris."}
