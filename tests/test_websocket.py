"""WebSocket mode on ``GET /v1/responses``, judged by the official clients.

The ``openai`` SDK's own WebSocket client (``client.responses.connect()``) and the OpenAI Agents SDK's
``responses_websocket_session`` drive a real gateway (uvicorn on loopback); a plain ``websockets`` client covers
what the SDKs do not expose (bad frames, the handshake's 401, close codes, back-to-back messages).

The upstream is a real loopback HTTP server whose /v1/responses streams are SYNTHESIZED in vLLM 0.32's framing
(``tests/vllm_frames.py``), written one frame at a time (optionally paced, as vLLM writes per token), and which
notices when the gateway closes a stream before its end.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from gateway.config import Settings
from tests.ops_support import FakeVllm, fake_vllm, wait_for
from tests.support import free_port, running_gateway, serve_in_thread
from tests.test_ops_shutdown import gateway_process
from tests.vllm_frames import VllmStream, args_deltas

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"

Answer = Callable[[dict[str, Any], VllmStream], None]


# --- the scripted upstream (synthesized, in vLLM 0.32's framing) ----------------------------------------------


class ScriptedUpstream:
    """POST /v1/responses answered by ``answer(body, stream)`` (which adds output items to a started stream),
    written frame by frame with ``pace`` seconds between frames. ``requests``/``headers``: what came, in order;
    ``cut[i]``: True when the gateway closed stream ``i`` before its last frame; ``ended[i]`` is set once
    stream ``i`` is over either way."""

    def __init__(self, answer: Answer, *, pace: float = 0.0) -> None:
        self.answer = answer
        self.pace = pace
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.cut: dict[int, bool] = {}
        self.ended: dict[int, threading.Event] = {}

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = json.loads(await request.body())
            n = len(self.requests)
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            self.ended[n] = threading.Event()
            stream = VllmStream(f"resp_{n:016x}", tools=body.get("tools") or []).start()
            self.answer(body, stream)
            frames = stream.complete().frames  # one SSE frame each

            async def gen():  # type: ignore[no-untyped-def]
                self.cut[n] = True
                try:
                    for i, frame in enumerate(frames):
                        if i and self.pace:
                            await asyncio.sleep(self.pace)
                        yield frame.encode()
                    self.cut[n] = False
                finally:
                    self.ended[n].set()

            return StreamingResponse(gen(), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"])])


def say(*deltas: str) -> Answer:
    def answer(body: dict[str, Any], stream: VllmStream) -> None:
        stream.message(f"msg_{len(stream.output):016x}", list(deltas))

    return answer


def echo(body: dict[str, Any], stream: VllmStream) -> None:
    """A message saying how many input items the upstream got: each turn's answer differs."""
    items = body["input"] if isinstance(body["input"], list) else [body["input"]]
    stream.message("msg_00000000000000e1", [f"seen {len(items)}"])


@contextmanager
def gateway_with(answer: Answer, *, pace: float = 0.0, **overrides: Any) -> Iterator[tuple[str, ScriptedUpstream]]:
    upstream = ScriptedUpstream(answer, pace=pace)
    with serve_in_thread(upstream.app()) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none", tool_choice_enforcement="off"),
                            **overrides) as url:
        yield url, upstream


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/responses"


def ws(url: str, **kwargs: Any) -> ClientConnection:
    return connect(ws_url(url), proxy=None, open_timeout=10, **kwargs)


def read_response(conn: ClientConnection, timeout: float = 10) -> list[dict[str, Any]]:
    """Events up to and including a terminal event (or an error frame)."""
    out = []
    while True:
        event = json.loads(conn.recv(timeout))
        out.append(event)
        if event["type"] in TERMINAL or event["type"] == "error":
            return out


def sdk_response(conn: Any) -> list[Any]:
    """The openai SDK's parsed events up to a terminal event or an error event."""
    out = []
    for event in conn:
        out.append(event)
        if event.type in TERMINAL or event.type == "error":
            break
    return out


def message_texts(items: list[dict[str, Any]] | str) -> list[tuple[str, str]]:
    """(role, text) of each message item, as the upstream got them (a string input: one user message)."""
    if isinstance(items, str):
        return [("user", items)]
    out = []
    for item in items:
        assert item.get("type", "message") == "message", item
        content = item["content"]
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        out.append((item["role"], text))
    return out


def client(url: str, api_key: str = "sk-test") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


# --- the openai SDK's WebSocket client --------------------------------------------------------------------------


def test_sdk_text_response() -> None:
    with gateway_with(say("Hello", ", ", "world.")) as (url, upstream), \
            client(url).responses.connect() as conn:
        conn.response.create(model="tiny", input="Say hello.", store=False)
        events = sdk_response(conn)
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello, world."
    final = events[-1].response
    assert final.output_text == "Hello, world." and final.status == "completed"
    assert final.id.startswith("resp_")
    [sent] = upstream.requests
    assert sent["stream"] is True and sent["model"] == "tiny"
    assert upstream.headers[0]["authorization"] == "Bearer sk-test"  # no gateway keys: passed on, as over HTTP
    assert message_texts(sent["input"]) == [("user", "Say hello.")]


def test_sdk_custom_tool_call_streams_its_input() -> None:
    def answer(body: dict[str, Any], stream: VllmStream) -> None:
        # the gateway sent apply_patch as a function taking {"input": ...}: answer as vLLM would
        stream.call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "apply_patch",
                    args_deltas({"input": PATCH}, 9))

    with gateway_with(answer) as (url, upstream), client(url).responses.connect() as conn:
        conn.response.create(model="tiny", input="Add hello.txt.", store=False,
                             tools=[{"type": "custom", "name": "apply_patch"}])
        events = sdk_response(conn)
    [sent] = upstream.requests
    [tool] = sent["tools"]
    assert tool["type"] == "function" and tool["name"] == "apply_patch", tool
    types = [e.type for e in events]
    assert types[-1] == "response.completed", types
    deltas = [e for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == PATCH
    assert "response.function_call_arguments.delta" not in types
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == PATCH
    [call] = events[-1].response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert call.call_id == "chatcmpl-tool-00000000000000a1" and call.id.startswith("ctc_")


def test_sdk_three_turns_chained_with_store_false_send_the_full_history_upstream() -> None:
    with gateway_with(echo) as (url, upstream), client(url).responses.connect() as conn:
        previous = None
        finals = []
        for word in ("one", "two", "three"):
            extra = {"previous_response_id": previous} if previous else {}
            conn.response.create(model="tiny", input=word, store=False, **extra)
            events = sdk_response(conn)
            assert events[-1].type == "response.completed", events[-1]
            previous = events[-1].response.id
            finals.append(events[-1].response)
    assert [f.output_text for f in finals] == ["seen 1", "seen 3", "seen 5"]
    assert len({f.id for f in finals}) == 3
    first, second, third = (message_texts(r["input"]) for r in upstream.requests)
    assert first == [("user", "one")]
    assert second == [("user", "one"), ("assistant", "seen 1"), ("user", "two")]
    assert third == [("user", "one"), ("assistant", "seen 1"), ("user", "two"), ("assistant", "seen 3"),
                     ("user", "three")]
    assert all("previous_response_id" not in r for r in upstream.requests)  # resolved by the gateway


def test_sdk_generate_false_then_a_chained_turn() -> None:
    with gateway_with(echo) as (url, upstream), client(url).responses.connect() as conn:
        conn.response.create(model="tiny", instructions="Be brief.", input="Context: the repo is empty.",
                             store=False, generate=False)
        warm = sdk_response(conn)
        assert upstream.requests == []  # nothing generated, nothing sent upstream
        assert warm[-1].type == "response.completed", warm[-1]
        assert warm[-1].response.output == []
        conn.response.create(model="tiny", input="Now answer.", store=False,
                             previous_response_id=warm[-1].response.id)
        events = sdk_response(conn)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "seen 2"
    [sent] = upstream.requests
    assert message_texts(sent["input"]) == [("user", "Context: the repo is empty."), ("user", "Now answer.")]


def test_sdk_unknown_previous_response_id_is_an_error_frame_and_the_connection_keeps_working() -> None:
    with gateway_with(say("Still here.")) as (url, upstream), client(url).responses.connect() as conn:
        conn.response.create(model="tiny", input="hi", store=False, previous_response_id="resp_doesnotexist")
        [error] = sdk_response(conn)
        conn.response.create(model="tiny", input="hi", store=False)
        events = sdk_response(conn)
    assert error.type == "error" and error.status == 400, error
    assert error.error.code == "previous_response_not_found" and error.error.type == "invalid_request_error"
    assert error.error.param == "previous_response_id" and "resp_doesnotexist" in error.error.message
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Still here."
    assert len(upstream.requests) == 1


# --- the OpenAI Agents SDK over the WebSocket ---------------------------------------------------------------------


async def test_agents_sdk_websocket_session_runs_a_function_tool_over_two_turns() -> None:
    from agents import Agent, function_tool, responses_websocket_session

    executed: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        executed.append(city)
        return f"Sunny in {city}."

    def answer(body: dict[str, Any], stream: VllmStream) -> None:
        items = body["input"] if isinstance(body["input"], list) else []
        if any(i.get("type") == "function_call_output" for i in items):
            stream.message("msg_00000000000000b2", ["It is ", "sunny in Paris."])
        else:
            stream.call("fc_00000000000000b1", "chatcmpl-tool-00000000000000b1", "get_weather",
                        args_deltas({"city": "Paris"}, 3))

    agent = Agent(name="weather", instructions="Answer with the tool.", model="tiny", tools=[get_weather])
    with gateway_with(answer) as (url, upstream):
        async with responses_websocket_session(base_url=url + "/v1", api_key="sk-test") as session:
            result = await session.run(agent, "What is the weather in Paris?")
        text = httpx.get(url + "/metrics").text
    assert executed == ["Paris"]
    assert result.final_output == "It is sunny in Paris."
    assert len(upstream.requests) == 2
    first, second = upstream.requests
    assert [t["name"] for t in first["tools"]] == ["get_weather"]
    # turn 2's upstream input holds turn 1's call and the tool's output (whether the SDK chained or resent)
    kinds = [i.get("type", "message") for i in second["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds, kinds
    [output] = [i for i in second["input"] if i.get("type") == "function_call_output"]
    assert "Sunny in Paris." in json.dumps(output)
    assert 'responses_gateway_websocket_messages_total{type="response.create"} 2.0' in text


# --- a plain websockets client -----------------------------------------------------------------------------------


def test_bad_json_and_unknown_message_types_get_error_frames_and_the_connection_stays_open() -> None:
    with gateway_with(say("ok")) as (url, upstream), ws(url) as conn:
        conn.send("{not json")
        bad = json.loads(conn.recv(10))
        conn.send(json.dumps({"type": "session.update", "session": {}}))
        unknown = json.loads(conn.recv(10))
        conn.send(json.dumps(["response.create"]))
        not_object = json.loads(conn.recv(10))
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
        events = read_response(conn)
    assert bad["type"] == "error" and bad["status"] == 400 and bad["error"]["code"] == "invalid_json", bad
    assert set(bad["error"]) >= {"type", "code", "message", "param"}
    assert bad["error"]["type"] == "invalid_request_error"
    assert unknown["status"] == 400 and unknown["error"]["code"] == "unknown_message_type", unknown
    assert unknown["error"]["param"] == "type" and "session.update" in unknown["error"]["message"]
    assert not_object["status"] == 400 and not_object["error"]["code"] == "unknown_message_type", not_object
    assert events[-1]["type"] == "response.completed"
    assert len(upstream.requests) == 1


def test_a_bad_request_body_is_an_error_frame_with_its_status() -> None:
    with gateway_with(say("ok")) as (url, upstream), ws(url) as conn:
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi", "background": True}))
        [background] = read_response(conn)
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": 5}))
        [bad_input] = read_response(conn)
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
        events = read_response(conn)
    assert background["status"] == 400 and background["error"]["param"] == "background", background
    assert bad_input["type"] == "error" and bad_input["status"] == 400, bad_input
    assert events[-1]["type"] == "response.completed"
    assert len(upstream.requests) == 1


def test_the_handshake_needs_a_key_when_keys_are_configured() -> None:
    with gateway_with(say("ok"), api_keys=("k1",)) as (url, upstream):
        with pytest.raises(InvalidStatus) as missing:
            ws(url)
        with pytest.raises(InvalidStatus) as wrong:
            ws(url, additional_headers={"Authorization": "Bearer nope"})
        with ws(url, additional_headers={"Authorization": "Bearer k1"}) as conn:
            conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
            events = read_response(conn)
        with client(url, api_key="k1").responses.connect() as sdk:  # the SDK sends its key on the handshake
            sdk.response.create(model="tiny", input="hi", store=False)
            sdk_events = sdk_response(sdk)
        text = httpx.get(url + "/metrics").text
    for exc in (missing, wrong):
        response = exc.value.response
        assert response.status_code == 401
        body = json.loads(response.body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key", body
        assert response.headers.get("www-authenticate") == "Bearer"
    assert "didn't provide an API key" in json.loads(missing.value.response.body)["error"]["message"]
    assert "nope" not in wrong.value.response.body.decode()
    assert events[-1]["type"] == "response.completed"
    assert sdk_events[-1].type == "response.completed"
    assert len(upstream.requests) == 2
    assert all("authorization" not in h for h in upstream.headers), upstream.headers  # the gateway key stays
    assert 'responses_gateway_rejected_requests_total{reason="unauthorized"} 2.0' in text


def test_a_client_closing_mid_stream_closes_the_upstream_request() -> None:
    long = [f"word{i} " for i in range(200)]  # ~200 paced frames: seconds, were it read to the end
    with gateway_with(say(*long), pace=0.02) as (url, upstream):
        with ws(url) as conn:
            conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "Talk a lot."}))
            first = [json.loads(conn.recv(10)) for _ in range(5)]
        # the client is gone: the gateway closes its upstream request well before the stream's end
        assert upstream.ended[0].wait(3), "the upstream stream was not closed after the client left"
        text = httpx.get(url + "/metrics").text
    assert [e["type"] for e in first[:2]] == ["response.created", "response.in_progress"]
    assert upstream.cut[0] is True
    assert "responses_gateway_websocket_connections 0.0" in text


def test_back_to_back_messages_run_one_after_the_other() -> None:
    with gateway_with(echo, pace=0.005) as (url, upstream), ws(url) as conn:
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "first"}))
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": [
            {"role": "user", "content": "second"}, {"role": "user", "content": "still second"}]}))
        events = []
        while sum(e["type"] in TERMINAL for e in events) < 2:
            events.append(json.loads(conn.recv(10)))
    split = next(i for i, e in enumerate(events) if e["type"] in TERMINAL) + 1
    one, two = events[:split], events[split:]
    for part in (one, two):
        assert part[0]["type"] == "response.created" and part[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in part] == list(range(len(part)))
        assert len({e["response"]["id"] for e in part if "response" in e}) == 1
    assert one[0]["response"]["id"] != two[0]["response"]["id"]
    assert one[-1]["response"]["output"][0]["content"][0]["text"] == "seen 1"
    assert two[-1]["response"]["output"][0]["content"][0]["text"] == "seen 2"
    assert [message_texts(r["input"]) for r in upstream.requests] == [
        [("user", "first")], [("user", "second"), ("user", "still second")]]


def test_a_message_over_max_body_bytes_closes_the_connection_with_1009() -> None:
    with gateway_with(say("ok"), max_body_bytes=2048) as (url, upstream), ws(url) as conn:
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "small"}))
        assert read_response(conn)[-1]["type"] == "response.completed"
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "x" * 4096}))
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    assert len(upstream.requests) == 1


def test_the_message_limit_counts_bytes_not_characters() -> None:
    with gateway_with(say("ok"), max_body_bytes=2048) as (url, upstream), ws(url) as conn:
        message = json.dumps({"type": "response.create", "model": "tiny", "input": "é" * 1500}, ensure_ascii=False)
        assert len(message) < 2048 < len(message.encode())
        conn.send(message)
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    assert upstream.requests == []


def test_an_idle_connection_is_closed_and_a_long_response_is_not_idleness() -> None:
    # ~45 frames 0.03 s apart: a response that runs well past the idle timeout
    with gateway_with(say(*(f"w{i} " for i in range(30))), pace=0.03, websocket_idle_timeout=0.5) as (url, _):
        with ws(url) as quiet:
            started = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                quiet.recv(10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000, closed.value
            assert 0.3 < time.monotonic() - started < 5
        with ws(url) as busy:
            busy.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
            events = read_response(busy)
            ended = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                busy.recv(10)
            waited = time.monotonic() - ended
    assert events[-1]["type"] == "response.completed"  # not cut by the idle timeout while it ran
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000, closed.value
    assert 0.3 < waited < 5, waited  # the idle clock started when the response ended


def test_an_unreachable_upstream_is_an_error_frame_and_the_connection_stays_open() -> None:
    settings = Settings(upstream_url=f"http://127.0.0.1:{free_port()}", store="none", tool_choice_enforcement="off")
    with running_gateway(settings) as url, ws(url) as conn:
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
        [error] = read_response(conn)
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "again"}))
        [again] = read_response(conn)
    assert error["status"] == 502 and error["error"]["code"] == "upstream_unavailable", error
    assert error["error"]["type"] == "server_error"
    assert again["status"] == 502


def test_metrics_count_connections_and_messages() -> None:
    with gateway_with(say("ok")) as (url, _):
        with ws(url) as conn:
            conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
            read_response(conn)
            conn.send(json.dumps({"type": "nope"}))
            conn.recv(10)
            during = httpx.get(url + "/metrics").text
        wait_for(lambda: "responses_gateway_websocket_connections 0.0" in httpx.get(url + "/metrics").text,
                 what="the connection gauge to drop")
        after = httpx.get(url + "/metrics").text
    assert "responses_gateway_websocket_connections 1.0" in during
    assert 'responses_gateway_websocket_messages_total{type="response.create"} 1.0' in after
    # an unknown type is counted as "other", never as its own (client-chosen) label value
    assert 'responses_gateway_websocket_messages_total{type="other"} 1.0' in after
    assert 'type="nope"' not in after


def test_sigterm_lets_the_response_in_flight_finish_then_closes_with_1001_and_exits_0() -> None:
    fake = FakeVllm(frame_delay=0.02)  # 48 frames: ~1 s
    with fake_vllm(fake) as (up, _), gateway_process(up, GATEWAY_DRAIN_TIMEOUT="5") as (url, proc):
        with ws(url) as conn, ws(url) as idle:
            conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
            events = [json.loads(conn.recv(10))]
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionClosed) as idle_closed:
                idle.recv(10)  # nothing running on it: closed at once
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    events.append(json.loads(conn.recv(15)))
        assert proc.wait(20) == 0
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    types = [e["type"] for e in events]
    # the recorded answer's own end (max_output_tokens), not a failure after the drain period
    assert types[-1] == "response.incomplete", types[-3:]
    assert "response.failed" not in types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001, closed.value
    assert idle_closed.value.rcvd is not None and idle_closed.value.rcvd.code == 1001, idle_closed.value
    assert "drain_timeout_reached" not in stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    [access] = [line for line in lines if line.get("event") == "request" and line.get("method") == "WEBSOCKET"]
    assert access["response_status"] == "incomplete" and access["status"] == 200


def test_a_stored_response_is_visible_over_the_websocket_to_its_owner_only(tmp_path: Any) -> None:
    from gateway.store import SqliteResponseStore

    upstream = ScriptedUpstream(echo)
    with serve_in_thread(upstream.app()) as (up_url, _), \
            running_gateway(Settings(upstream_url=up_url, store="none", tool_choice_enforcement="off"),
                            store=SqliteResponseStore(tmp_path / "r.db"), api_keys=("k1", "k2")) as url:
        with ws(url, additional_headers={"Authorization": "Bearer k1"}) as first:  # stored (store defaults to true)
            first.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
            stored = read_response(first)[-1]["response"]
        turn = json.dumps({"type": "response.create", "model": "tiny", "input": "again",
                           "previous_response_id": stored["id"]})
        with ws(url, additional_headers={"Authorization": "Bearer k2"}) as other:
            other.send(turn)
            refused = read_response(other)
        with ws(url, additional_headers={"Authorization": "Bearer k1"}) as owner:
            owner.send(turn)
            chained = read_response(owner)
    assert refused[-1]["type"] == "error" and refused[-1]["status"] == 400
    assert refused[-1]["error"]["code"] == "previous_response_not_found"  # as for an id that does not exist
    assert chained[-1]["type"] == "response.completed"
    assert chained[-1]["response"]["previous_response_id"] == stored["id"]


def test_events_carry_the_stream_id_their_response_create_gave() -> None:
    with gateway_with(say("ok")) as (url, _upstream), ws(url) as conn:
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi", "stream_id": "lane-7"}))
        events = read_response(conn)
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi"}))
        plain = read_response(conn)
        conn.send(json.dumps({"type": "response.create", "model": "tiny", "input": 5, "stream_id": "lane-8"}))
        error = read_response(conn)
    assert events[-1]["type"] == "response.completed"
    assert {e.get("stream_id") for e in events} == {"lane-7"}
    assert all("stream_id" not in e for e in plain)
    assert error[-1]["type"] == "error" and error[-1]["stream_id"] == "lane-8"
