"""--upstream-api chat: a real gateway in front of recorded (and synthesized) /v1/chat/completions answers."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import cassette, replay, running_gateway, sse_events

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name."}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Get the current time in a timezone.",
        "parameters": {"type": "object",
                       "properties": {"timezone": {"type": "string", "description": "IANA timezone."}},
                       "required": ["timezone"], "additionalProperties": False}}


def recorded_body(name: str, index: int = 0) -> dict[str, Any]:
    body = load_cassette(cassette(name)).interactions[index].request_body
    assert body is not None
    return body


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def chat_gateway(transport: Any, **overrides: Any) -> Any:
    return running_gateway(transport=transport, upstream_api="chat", **overrides)


def test_text_streamed_and_not_sends_what_was_recorded() -> None:
    for variant in ("nonstream", "stream"):
        name = f"chat_text_{variant}"
        transport = replay(name)
        request = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 48, "stream": variant == "stream"}
        with chat_gateway(transport) as url:
            r = post(url, request)
        assert r.status_code == 200
        assert transport.requests[0]["path"] == "/v1/chat/completions"
        assert transport.requests[0]["body"] == recorded_body(name)
        if variant == "stream":
            summary = check_stream(sse_events(r.content), request)
            final = summary["response"]
            assert summary["terminal"] == "response.incomplete"  # the tiny model hit max_tokens
        else:
            final = r.json()
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
        [msg] = final["output"]
        assert msg["type"] == "message" and msg["id"].startswith("msg_") and msg["content"][0]["text"]
        assert final["usage"]["input_tokens"] == 20 and final["usage"]["output_tokens"] == 48


def test_tool_calls_streamed_and_not_with_enforcement_off() -> None:
    for variant in ("nonstream", "stream"):
        name = f"chat_tool_call_{variant}"
        transport = replay(name)
        request = {"model": "tiny", "input": "What is the weather in Paris?", "tools": [WEATHER, TIME],
                   "tool_choice": "required", "max_output_tokens": 96, "seed": 1, "stream": variant == "stream"}
        with chat_gateway(transport, tool_choice_enforcement="off") as url:
            r = post(url, request)
        assert transport.requests[0]["body"] == recorded_body(name)
        final = check_stream(sse_events(r.content), request)["response"] if variant == "stream" else r.json()
        [call] = final["output"]
        # what the tiny model really answered: a get_time call with arguments "null" (off: passed through)
        assert call["type"] == "function_call" and call["name"] == "get_time" and call["arguments"] == "null"
        assert call["call_id"].startswith("chatcmpl-tool-") and call["id"].startswith("fc_")
        assert final["status"] == "completed" and final["tool_choice"] == "required"


def test_history_with_calls_and_array_tool_output_is_sent_as_vllm_accepts_it() -> None:
    for variant in ("nonstream", "stream"):
        name = f"chat_tool_array_content_{variant}"
        recorded = recorded_body(name)
        fn = recorded["tools"][0]["function"]
        call = recorded["messages"][1]["tool_calls"][0]
        request = {"model": "tiny", "max_output_tokens": 48, "stream": variant == "stream",
                   "tools": [{"type": "function", **fn}],
                   "input": [{"role": "user", "content": "Create an empty patch."},
                             {"type": "function_call", "call_id": call["id"], "name": "apply_patch",
                              "arguments": call["function"]["arguments"]},
                             {"type": "function_call_output", "call_id": call["id"],
                              "output": [{"type": "input_text", "text": "Patch applied."}]}]}
        transport = replay(name)
        with chat_gateway(transport) as url:
            r = post(url, request)
        assert r.status_code == 200
        assert transport.requests[0]["body"] == recorded


def test_reasoning_streamed_and_not() -> None:
    for variant in ("nonstream", "stream"):
        transport = replay(f"chat_reasoning_{variant}")
        request = {"model": "tiny", "input": "Say hello.", "stream": variant == "stream"}
        with chat_gateway(transport) as url:
            r = post(url, request)
        final = check_stream(sse_events(r.content), request)["response"] if variant == "stream" else r.json()
        reasoning, message = final["output"]
        assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "The user wants a greeting."
        assert message["content"][0]["text"] == "Hello!" and final["status"] == "completed"


def test_openai_sdk_strict_stream_accepts_chat_mode_streams() -> None:
    transport = replay("chat_reasoning_calls_stream")
    with chat_gateway(transport) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model="tiny", input="Weather in Paris?", tools=[WEATHER]) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "function_call", "function_call"]
    assert kinds.count("response.function_call_arguments.delta") == 4
    assert final.output[1].arguments == '{"city": "Paris"}'
    transport = replay("chat_reasoning_stream")
    with chat_gateway(transport) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model="tiny", input="Say hello.") as stream:
            final = stream.get_final_response()
    assert final.output_text == "Hello!"


def test_mid_stream_error_chunk_ends_with_response_failed() -> None:
    transport = replay("chat_error_midstream_stream")
    with chat_gateway(transport) as url:
        r = post(url, {"model": "tiny", "input": "Say hello.", "stream": True})
    summary = check_stream(sse_events(r.content))
    assert summary["terminal"] == "response.failed"
    assert summary["response"]["error"]["message"] == "EngineCore encountered an issue."


def test_upstream_http_error_is_passed_on() -> None:
    transport = replay("error_unknown_model_nonstream")  # a /v1/responses recording: chat path has none -> 404
    with chat_gateway(transport) as url:
        r = post(url, {"model": "tiny", "input": "hi"})
    assert r.status_code == 404 and "error" in r.json()
