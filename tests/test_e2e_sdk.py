"""End to end: the official openai SDK against a running gateway in front of recorded vLLM answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.config import Settings
from tests.invariants import check_stream
from tests.support import replay, running_gateway, sse_events
from tests.vllm_frames import VllmStream

APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/s'}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(url: str, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, **kw)  # type: ignore[arg-type]


def test_strict_stream_helper_accepts_a_custom_tool_call_and_the_final_response_has_it() -> None:
    transport = replay("custom_tool_call_strict_stream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        with client(url).responses.stream(model="tiny", input="patch", tools=[APPLY_PATCH],
                                           tool_choice={"type": "custom", "name": "apply_patch"},
                                           metadata={"run": "7"}) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    [call] = final.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.id.startswith("ctc_")
    assert kinds.count("response.custom_tool_call_input.delta") >= 2
    assert "response.function_call_arguments.delta" not in kinds
    assert final.tools[0].type == "custom" and final.metadata == {"run": "7"}
    # what vLLM got: a strict function shim, named choice, no state
    sent = transport.requests[0]["body"]
    assert sent["tools"][0]["type"] == "function" and sent["tools"][0]["parameters"]["required"] == ["input"]
    assert sent["tool_choice"] == {"type": "function", "name": "apply_patch"} and sent["store"] is False
    assert "metadata" in sent  # unknown-to-vLLM fields are passed through untouched


def test_non_streamed_custom_tool_call_round_trip() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("custom_tool_call_strict_nonstream")) as url:
        resp = client(url).responses.create(model="tiny", input="patch", tools=[APPLY_PATCH],
                                            tool_choice={"type": "custom", "name": "apply_patch"})
    [call] = resp.output
    assert call.type == "custom_tool_call" and isinstance(call.input, str) and not call.input.startswith("{")
    assert resp.tool_choice.type == "custom" and resp.parallel_tool_calls is True and resp.error is None


def test_raw_stream_with_function_call_passes_through_as_a_function_call() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("function_call_stream")) as url:
        events = [e.model_dump() for e in client(url).responses.create(
            model="tiny", input="weather?", tools=[WEATHER], tool_choice="required", stream=True)]
    summary = check_stream(events)
    assert summary["response"]["tool_choice"] == "required"
    assert summary["response"]["tools"][0]["name"] == "get_weather"
    assert [i["type"] for i in summary["items"]] == ["function_call"]
    assert summary["items"][0]["name"] == "get_weather"


def test_text_stream_and_get_final_response() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_stream")) as url:
        with client(url).responses.stream(model="tiny", input="hi") as stream:
            for _ in stream:
                pass
            # vLLM cut this one off at max_output_tokens: OpenAI's event for that is response.incomplete
            with pytest.raises(RuntimeError):
                stream.get_final_response()


def test_two_calls_through_the_strict_helper() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("interleaved_three_calls_stream")) as url:
        with client(url).responses.stream(model="tiny", input="x", tools=[APPLY_PATCH, WEATHER,
                                          {**WEATHER, "name": "get_time"}]) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
    assert [i.type for i in final.output] == ["message", "function_call", "message", "custom_tool_call",
                                              "function_call"]


@pytest.mark.parametrize("name,status", [("error_unknown_model_stream", 404), ("error_unknown_model_nonstream", 404),
                                         ("error_bad_tool_type_stream", 400), ("error_bad_tool_type_nonstream", 400)])
def test_upstream_errors_before_the_stream_keep_their_status_in_openai_shape(name: str, status: int) -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay(name)) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "x", "input": "hi", "stream": name.endswith("_stream"),
                                                    "tools": [{"type": "frobnicate"}]})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and (err["code"] is None or isinstance(err["code"], str))


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"model": "tiny", "input": 42}', "input"),
    (b'{"model": "tiny", "input": "x", "stream": "yes"}', "stream"),
    (b'{"model": "tiny", "input": "x", "tools": [{"type": "custom"}]}', "tools[0].name"),
    (b'{"model": "tiny", "input": "x", "tools": "nope"}', "tools"),
    (b'{"model": "tiny", "input": "x", "tool_choice": {"type": "custom", "name": "nope"}}', "tool_choice.name"),
    (b'{"model": "tiny", "input": "x", "metadata": {"a": 1}}', "metadata.a"),
])
def test_bad_input_is_a_400_in_openai_shape(body: bytes, param: str | None) -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        r = httpx.post(url + "/v1/responses", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert "Traceback" not in r.text and transport.requests == []


def test_oversized_body_is_a_413_even_without_content_length() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("text_nonstream"), max_body_bytes=1000) as url:
        big = json.dumps({"model": "tiny", "input": "x" * 5000}).encode()
        r1 = httpx.post(url + "/v1/responses", content=big)

        def chunks():  # chunked transfer: no content-length header
            yield big[:600]
            yield big[600:]

        r2 = httpx.post(url + "/v1/responses", content=chunks())
    for r in (r1, r2):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], *, then: str = "hang") -> None:
        self.chunks, self.then = chunks, then
        self.closed = threading.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.then == "break":
            raise httpx.ReadError("connection reset by peer")
        await asyncio.sleep(3600)

    async def aclose(self) -> None:
        self.closed.set()


class _Upstream(httpx.AsyncBaseTransport):
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=self.stream)


def _partial_stream() -> list[bytes]:
    s = VllmStream().start()
    s.call("fc_1", "call_1", "apply_patch", ['{"input": "*** Begin', ' Patch\\n'], args_done=False, item_done=False)
    return [f.encode() for f in s.frames]


def test_client_disconnect_closes_the_upstream_request_at_once() -> None:
    upstream = _Stream(_partial_stream(), then="hang")
    with running_gateway(tool_choice_enforcement="off", transport=_Upstream(upstream)) as url:
        with httpx.Client(timeout=10) as http, http.stream(
                "POST", url + "/v1/responses",
                json={"model": "tiny", "input": "x", "stream": True, "tools": [APPLY_PATCH]}) as r:
            first = next(r.iter_raw())
            assert first.startswith(b"event: response.created")
            start = time.monotonic()
        assert upstream.closed.wait(5), "upstream request was not closed after the client left"
        assert time.monotonic() - start < 2


def test_broken_upstream_ends_the_client_stream_with_response_failed() -> None:
    upstream = _Stream(_partial_stream(), then="break")
    with running_gateway(tool_choice_enforcement="off", transport=_Upstream(upstream)) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "stream": True,
                                                    "tools": [APPLY_PATCH]}, timeout=10)
    events = sse_events(r.content)
    summary = check_stream(events)
    assert summary["terminal"] == "response.failed"
    assert summary["response"]["error"]["code"] == "upstream_connection_error"
    assert summary["items"][0]["type"] == "custom_tool_call"
    assert upstream.closed.is_set()


def test_unreachable_upstream_is_a_502_in_openai_shape() -> None:
    settings = Settings(upstream_url="http://127.0.0.1:9", store="none", connect_timeout=1)
    with running_gateway(settings) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "stream": True})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"


def test_other_paths_are_proxied_unchanged_and_streams_stream_through() -> None:
    transport = replay("chat_text_stream")
    with running_gateway(tool_choice_enforcement="off", transport=transport, upstream_api_key="sk-upstream") as url:
        r = httpx.post(url + "/v1/chat/completions?x=1", json={"model": "tiny", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}, headers={"authorization": "Bearer sk-client"})
    recorded = transport.cassettes[0].interactions[0].body
    assert r.status_code == 200 and r.content == recorded
    sent = transport.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["body"]["messages"][0]["content"] == "hi"
    assert sent["headers"]["authorization"] == "Bearer sk-upstream"  # the upstream key replaces the client's


def test_client_authorization_is_forwarded_without_an_upstream_key() -> None:
    transport = replay("text_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x"},
                   headers={"authorization": "Bearer sk-client"})
    assert transport.requests[0]["headers"]["authorization"] == "Bearer sk-client"


def test_streams_are_sse_with_one_frame_per_event() -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay("custom_tool_call_strict_stream")) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "stream": True,
                                                    "tools": [APPLY_PATCH]})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    assert r.content.endswith(b"\n\n") and b"data: [DONE]" not in r.content
    check_stream(sse_events(r.content), {"tools": [APPLY_PATCH]})
