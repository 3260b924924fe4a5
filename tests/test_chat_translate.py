"""Responses <-> Chat Completions conversion (gateway/translate/chat.py), without a server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.protocol.events import ClientEvent
from gateway.protocol.sse import SseParser, encode_events
from gateway.runtime import new_id
from gateway.translate.chat import ChatToResponsesEvents, build_chat_request, chat_messages
from gateway.translate.restore import build_request_state
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from gateway.upstream.chat import chat_completion_events
from gateway.upstream.replay import load_cassette
from tests.invariants import check_stream
from tests.support import CASSETTES, cassette, sse_events

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


def _ctx_body(**body: Any) -> tuple[dict[str, Any], Any]:
    body = {"model": "tiny", **body}
    return body, resolve_tool_context(body)


def test_request_conversion_covers_every_input_item_kind() -> None:
    body, ctx = _ctx_body(
        instructions="Be terse.", max_output_tokens=50, temperature=0.2, top_p=0.9, seed=3, stream=True,
        tools=[WEATHER, PATCH], tool_choice={"type": "custom", "name": "apply_patch"}, parallel_tool_calls=False,
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Look: "},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                          "text": "thinking"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Both done."}]},
            {"role": "user", "content": "Thanks"},
        ])
    up = build_chat_request(body, ctx)
    assert up["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                         "detail": "auto"}}]},
        {"role": "assistant", "content": None, "reasoning": "thinking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin Patch"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "done"},
        {"role": "assistant", "content": "Both done."},
        {"role": "user", "content": "Thanks"},
    ]
    assert up["max_tokens"] == 50 and up["temperature"] == 0.2 and up["top_p"] == 0.9 and up["seed"] == 3
    assert up["stream"] is True and up["stream_options"] == {"include_usage": True}
    assert up["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    assert up["parallel_tool_calls"] is False
    names = [t["function"]["name"] for t in up["tools"]]
    assert names == ["get_weather", "apply_patch"]
    shim = up["tools"][1]["function"]
    assert shim["parameters"]["required"] == ["input"] and shim["strict"] is True


def test_tool_choice_none_offers_no_tools_and_auto_is_left_to_chat_default() -> None:
    body, ctx = _ctx_body(input="hi", tools=[WEATHER], tool_choice="none")
    up = build_chat_request(body, ctx)
    assert "tools" not in up and "tool_choice" not in up
    body, ctx = _ctx_body(input="hi", tools=[WEATHER])
    up = build_chat_request(body, ctx)
    assert "tool_choice" not in up and up["tools"][0]["function"]["name"] == "get_weather"
    body, ctx = _ctx_body(input="hi", tools=[WEATHER], tool_choice="required")
    assert build_chat_request(body, ctx)["tool_choice"] == "required"


def test_text_format_maps_to_response_format_and_files_are_refused() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body, ctx = _ctx_body(input="x", text={"format": {"type": "json_schema", "name": "out", "schema": schema,
                                                      "strict": True}})
    assert build_chat_request(body, ctx)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    body, ctx = _ctx_body(input=[{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}])
    with pytest.raises(InvalidRequest):
        chat_messages(body, ctx)


def _translate_chat_stream(raw: bytes, request: dict[str, Any], chunk: int | None = None
                           ) -> tuple[list[dict[str, Any]], FunctionSseTranslator]:
    ctx = resolve_tool_context(request)
    translator = FunctionSseTranslator(build_request_state(request, ctx, response_id="resp_test", created_at=1),
                                       ids=new_id)
    conv = ChatToResponsesEvents(model="tiny", ids=new_id, clock=time.time)
    parser = SseParser()
    out: list[ClientEvent] = []
    pieces = [raw] if chunk is None else [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
    for piece in pieces:
        for _event, data in parser.feed(piece):
            events = conv.done() if data == "[DONE]" else conv.feed(orjson.loads(data))
            for ev in events:
                out += translator.feed(ev)
    out += translator.finish()
    return sse_events(encode_events(out)), translator


CHAT_STREAMS = [p for folder in ("vllm", "synthesized") for p in sorted((CASSETTES / folder).glob("chat_*_stream.yaml"))
                if load_cassette(p).interactions[0].status == 200
                and load_cassette(p).interactions[0].path == "/v1/chat/completions"]


@pytest.mark.parametrize("path", CHAT_STREAMS, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk", [None, 1, 13])
def test_every_chat_stream_cassette_translates_to_a_valid_responses_stream(path: Path, chunk: int | None) -> None:
    inter = load_cassette(path).interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [WEATHER, {**WEATHER, "name": "get_time"}, PATCH]}
    events, _ = _translate_chat_stream(inter.body, request, chunk)
    summary = check_stream(events, request)
    if "error_midstream" in path.stem:
        assert summary["terminal"] == "response.failed"
        assert summary["response"]["error"]["message"] == "EngineCore encountered an issue."
    else:
        assert summary["terminal"] in ("response.completed", "response.incomplete")
        assert summary["response"]["usage"]["total_tokens"] > 0


def test_reasoning_then_text() -> None:
    inter = load_cassette(cassette("chat_reasoning_stream")).interactions[0]
    events, _ = _translate_chat_stream(inter.body, {"model": "tiny", "input": "Say hello."})
    summary = check_stream(events)
    reasoning, message = summary["items"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "The user wants a greeting."
    assert message["content"][0]["text"] == "Hello!"
    assert [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"] == \
        ["The user ", "wants a ", "greeting."]
    assert summary["terminal"] == "response.completed"


def test_chat_tool_calls_become_calls_with_the_core_guarantees() -> None:
    inter = load_cassette(cassette("chat_reasoning_calls_stream")).interactions[0]
    request = {"model": "tiny", "input": "x", "tools": [WEATHER]}
    events, _ = _translate_chat_stream(inter.body, request, chunk=5)
    items = check_stream(events, request)["items"]
    assert [i["type"] for i in items] == ["reasoning", "function_call", "function_call"]
    assert [i["arguments"] for i in items[1:]] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert [i["call_id"] for i in items[1:]] == ["chatcmpl-tool-5y7h0000000000c1", "chatcmpl-tool-5y7h0000000000c2"]
    # parallel_tool_calls false: the core translator keeps the first call only
    events, _ = _translate_chat_stream(inter.body, {**request, "parallel_tool_calls": False})
    assert [i["type"] for i in check_stream(events)["items"]] == ["reasoning", "function_call"]


def test_custom_tool_call_from_chat_is_a_custom_tool_call_with_input_deltas() -> None:
    inter = load_cassette(cassette("chat_named_tool_stream")).interactions[0]  # apply_patch, arguments "null"
    request = {"model": "tiny", "input": "x", "tools": [PATCH]}
    events, _ = _translate_chat_stream(inter.body, request)
    [call] = check_stream(events, request)["items"]
    assert call["type"] == "custom_tool_call" and call["id"].startswith("ctc_") and call["input"] == "null"


def test_a_stream_that_ends_without_finish_reason_fails() -> None:
    body = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
            b'"delta":{"role":"assistant","content":"Hel"},"logprobs":null,"finish_reason":null}]}\n\n')
    events, _ = _translate_chat_stream(body, {"model": "tiny", "input": "x"})
    summary = check_stream(events)
    assert summary["terminal"] == "response.failed"
    assert summary["response"]["error"]["code"] == "upstream_stream_incomplete"


def test_non_streamed_completion_gives_the_same_items() -> None:
    payload = orjson.loads(load_cassette(cassette("chat_reasoning_calls_nonstream")).interactions[0].body)
    request = {"model": "tiny", "input": "x", "tools": [WEATHER]}
    ctx = resolve_tool_context(request)
    translator = FunctionSseTranslator(build_request_state(request, ctx, response_id="resp_t", created_at=1),
                                       ids=new_id)
    for ev in chat_completion_events(payload, ChatToResponsesEvents(ids=new_id, clock=time.time)):
        translator.feed(ev)
    final = translator.final_response
    assert final is not None and final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call", "function_call"]
    assert final["usage"]["input_tokens"] == 180 and final["usage"]["output_tokens"] == 30


def test_tool_choice_none_on_the_responses_path_offers_no_tools_either() -> None:
    from gateway.translate.rewrite import build_upstream_request

    body, ctx = _ctx_body(input="hi", tools=[WEATHER, PATCH], tool_choice="none")
    up = build_upstream_request(body, ctx)
    assert "tools" not in up and up["tool_choice"] == "none"
