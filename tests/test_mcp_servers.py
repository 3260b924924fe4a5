"""Remote MCP tools end to end: a running gateway, REAL MCP servers, a scripted vLLM upstream.

The MCP servers are real processes (tests/mcp_servers.py): the official Python SDK's ``MCPServer`` fixture server
(tools add/echo/fail/sleep/…, recording each call with its headers) over streamable HTTP and over the older
HTTP+SSE transport, and the TypeScript reference server ``@modelcontextprotocol/server-everything``. The gateway
builds its real hub from its settings (allowlist, servers file, pooled SDK sessions).

The upstream is SYNTHESIZED in vLLM 0.32's framing — Responses SSE frames from tests/vllm_frames.py
``VllmStream``, and Chat Completions chunks as recorded in cassettes/vllm/chat_tool_call_stream.yaml — answered by
an ``httpx.MockTransport``: the model calls an MCP tool as the function the gateway offered it
(``mcp_name(label, tool)``), then answers in text once it has the tool's output.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import structlog.testing

from gateway.mcp.session import McpPool
from gateway.store import SqliteResponseStore
from gateway.translate.mcp_items import mcp_name
from tests.invariants import TERMINALS
from tests.support import running_gateway, sse_events
from tests.vllm_frames import VllmStream

if TYPE_CHECKING:  # imported by pytest as a plugin (below), so that its asserts are rewritten too
    from tests.mcp_servers import McpTestServer

pytest_plugins = ["tests.mcp_servers"]

LOOPBACK = ("127.0.0.1",)
Round = Any  # a stream (VllmStream / ChatStream), or a function of the request body that builds one


# --- the scripted upstream --------------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def _first_user_text(body: dict[str, Any]) -> str:
    items = body.get("messages") if "messages" in body else body.get("input")
    if isinstance(items, str):
        return items
    for item in items or ():
        if isinstance(item, dict) and item.get("role") == "user":
            return _text_of(item.get("content"))
    return ""


class Upstream:
    """vLLM, scripted per conversation: the rounds for the first user message (the last one repeats).

    Every request is kept (path, body); concurrent requests of different conversations each get their own
    script, so requests may overlap."""

    def __init__(self, scripts: dict[str, list[Round]]) -> None:
        self.scripts = scripts
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [b for _, b in self.requests]

    def bodies_for(self, key: str) -> list[dict[str, Any]]:
        return [b for b in self.bodies if _first_user_text(b) == key]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = _first_user_text(body)
        with self._lock:
            self.requests.append((request.url.path, body))
            n = self.served.get(key, 0)
            self.served[key] = n + 1
        rounds = self.scripts[key]
        chosen = rounds[min(n, len(rounds) - 1)]
        stream = chosen(body) if callable(chosen) else chosen
        if request.url.path.endswith("/chat/completions"):
            assert isinstance(stream, ChatStream), "a chat request needs a chat script"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.body())


def _hex() -> str:
    return secrets.token_hex(8)  # vLLM's item ids are random: each round's differ


def call_round(label: str, *calls: tuple[str, dict[str, Any]]) -> Callable[[dict[str, Any]], VllmStream]:
    """A round calling MCP tools (as the functions the gateway offered), built per request with fresh ids."""

    def build(_: dict[str, Any]) -> VllmStream:
        s = VllmStream(response_id=f"resp_{_hex()}").start()
        for tool, args in calls:
            text = json.dumps(args)
            s.call(f"fc_{_hex()}", f"call_{_hex()}", mcp_name(label, tool),
                   [text[: len(text) // 2], text[len(text) // 2 :]])
        return s.complete()

    return build


def text_round(text: str) -> VllmStream:
    return VllmStream(response_id=f"resp_{_hex()}").start().message(f"msg_{_hex()}", [text]).complete()


def echo_output(body: dict[str, Any]) -> VllmStream:
    """The model repeats the last tool output it was given (so a test sees what the model was told)."""
    last = body["input"][-1]
    assert last["type"] == "function_call_output", last
    return text_round(f"The tool said: {last['output']}")


class ChatStream:
    """Chat Completions chunks in vLLM 0.32's framing (cassettes/vllm/chat_tool_call_stream.yaml)."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.head = {"id": "chatcmpl-83913b2c8e790873", "object": "chat.completion.chunk", "created": 1795973038,
                     "model": "tiny"}
        self.frames.append({**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": None, "prompt_text": None})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.frames.append({**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None, "token_ids": None}]})

    def call(self, index: int, call_id: str, name: str, pieces: list[str]) -> ChatStream:
        self._delta({"content": None, "tool_calls": [{"id": call_id, "type": "function", "index": index,
                                                      "function": {"name": name}}]})
        for piece in pieces:
            self._delta({"content": None, "tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return self

    def text(self, pieces: list[str]) -> ChatStream:
        for piece in pieces:
            self._delta({"content": piece})
        return self

    def finish(self, reason: str) -> ChatStream:
        self.frames.append({**self.head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                      "finish_reason": reason, "stop_reason": None,
                                                      "token_ids": None}]})
        self.frames.append({**self.head, "choices": [], "usage": {"prompt_tokens": 375, "total_tokens": 427,
                                                                  "completion_tokens": 52},
                            "system_fingerprint": "vllm-0.32.0-ed9cb571"})
        return self

    def body(self) -> bytes:
        lines = [f"data: {json.dumps(f, separators=(',', ':'), ensure_ascii=False)}\n\n" for f in self.frames]
        return ("".join(lines) + "data: [DONE]\n\n").encode()


# --- helpers ----------------------------------------------------------------------------------------------


def mcp_tool(label: str, server: McpTestServer, **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": server.url, "require_approval": "never", **fields}


def post(url: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=timeout)


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = post(url, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events if e["type"] in TERMINALS] == [events[-1]["type"]]
    return events


def new_calls(server: McpTestServer, before: int) -> list[dict[str, Any]]:
    return server.calls()[before:]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def list_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``tools/list`` the gateway's pool makes (server labels): the fixture server records tool calls only."""
    seen: list[str] = []
    original = McpPool.list_tools

    async def counting(self: McpPool, server: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(server.label)
        return await original(self, server, *args, **kwargs)

    monkeypatch.setattr(McpPool, "list_tools", counting)
    return seen


@pytest.fixture
def call_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``tools/call`` the gateway's pool makes (tool names), wherever it goes."""
    seen: list[str] = []
    original = McpPool.call_tool

    async def counting(self: McpPool, server: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(name)
        return await original(self, server, name, *args, **kwargs)

    monkeypatch.setattr(McpPool, "call_tool", counting)
    return seen


# --- listing, one call, the answer ------------------------------------------------------------------------

SERVERS = {
    # fixture: (fixture name, tool, arguments, expected output, a listed tool that must be there)
    "fixture": ("mcp_fixture_server", "add", {"a": 2, "b": 3}, "5", {"add", "echo", "fail", "sleep"}),
    "everything": ("mcp_everything_server", "get-sum", {"a": 2, "b": 3}, "The sum of 2 and 3 is 5.",
                   {"echo", "get-sum"}),
    "sse": ("mcp_sse_server", "add", {"a": 2, "b": 3}, "5", {"add", "echo"}),  # the older HTTP+SSE transport
}


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not_streamed"])
@pytest.mark.parametrize("which", list(SERVERS))
def test_list_call_and_answer(request: pytest.FixtureRequest, which: str, streamed: bool) -> None:
    fixture, tool, args, expected, listed = SERVERS[which]
    server: McpTestServer = request.getfixturevalue(fixture)
    key = f"{which} {streamed}: what is 2 + 3?"
    up = Upstream({key: [call_round(which, (tool, args)), echo_output]})
    before = len(server.calls()) if which != "everything" else 0
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        client = sdk(url)
        tools = [mcp_tool(which, server)]
        if streamed:
            with client.responses.stream(model="tiny", input=key, tools=tools) as s:  # type: ignore[arg-type]
                kinds = [e.type for e in s]
                final = s.get_final_response()
            assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
            order = ["response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                     "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
                     "response.mcp_call.in_progress", "response.mcp_call.completed", "response.output_text.delta"]
            positions = [kinds.index(k) for k in order]
            assert positions == sorted(positions)
            assert not any(k.startswith("response.function_call") for k in kinds)
        else:
            final = client.responses.create(model="tiny", input=key, tools=tools)  # type: ignore[arg-type]
    assert final.status == "completed"
    assert [o.type for o in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, message = final.output
    assert listing.server_label == which and listing.error is None  # type: ignore[union-attr]
    assert listed <= {t.name for t in listing.tools}  # type: ignore[union-attr]
    assert call.name == tool and call.server_label == which and call.status == "completed"  # type: ignore[union-attr]
    assert call.output == expected and call.error is None and json.loads(call.arguments) == args  # type: ignore[union-attr]
    assert message.content[0].text == f"The tool said: {expected}"  # type: ignore[union-attr]
    # the model was offered the server's tools as functions, and got the call and its output back
    first, second = up.bodies
    offered = {t["name"] for t in first["tools"]}
    assert {mcp_name(which, t) for t in listed} <= offered
    assert second["input"][-2]["type"] == "function_call" and second["input"][-2]["name"] == mcp_name(which, tool)
    assert second["input"][-1]["output"] == expected
    if which != "everything":  # the reference server records nothing; its output says it ran
        assert [(c["tool"], c["arguments"]) for c in new_calls(server, before)] == [(tool, args)]


def test_two_rounds_in_one_response(mcp_fixture_server: McpTestServer) -> None:
    key = "two rounds"
    up = Upstream({key: [call_round("calc", ("add", {"a": 40, "b": 2})),
                         call_round("calc", ("echo", {"text": "forty-two"})), echo_output]})
    before = len(mcp_fixture_server.calls())
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        events = stream(url, {"model": "tiny", "input": key, "tools": [mcp_tool("calc", mcp_fixture_server)]})
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert [i["output"] for i in final["output"][1:3]] == ["42", "forty-two"]
    assert [e["type"] for e in events].count("response.created") == 1
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2, 3]
    assert len({i["id"] for i in final["output"]}) == 4
    assert final["usage"]["total_tokens"] == 3 * 160
    assert [c["tool"] for c in new_calls(mcp_fixture_server, before)] == ["add", "echo"]
    assert len(up.bodies) == 3 and up.bodies[2]["input"][-1]["output"] == "forty-two"


def test_calls_of_one_round_run_concurrently_on_the_pooled_session(mcp_fixture_server: McpTestServer) -> None:
    key = "three sleeps"
    up = Upstream({key: [call_round("calc", ("sleep", {"seconds": 0.8}), ("sleep", {"seconds": 0.8}),
                                    ("echo", {"text": "quick"})), echo_output]})
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        started = time.monotonic()
        events = stream(url, {"model": "tiny", "input": key, "tools": [mcp_tool("calc", mcp_fixture_server)]})
        elapsed = time.monotonic() - started
    out = events[-1]["response"]["output"]
    assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_call", "mcp_call", "mcp_call", "message"]
    assert [i["output"] for i in out[1:4]] == ["slept 0.8", "slept 0.8", "quick"]  # in the model's order
    assert elapsed < 1.5  # not one after the other (1.6 s and more)
    # the quick call finished first: its completion was streamed before the sleeps'
    done = [e["item_id"] for e in events if e["type"] == "response.mcp_call.completed"]
    assert done[0] == out[3]["id"] and sorted(done) == sorted(i["id"] for i in out[1:4])
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3, 4]
    # the next round gets each call with its output, in the model's order
    sent = up.bodies[1]["input"][1:]
    assert [(i["type"], i["call_id"]) for i in sent] == [
        (t, item["id"]) for item in out[1:4] for t in ("function_call", "function_call_output")]
    assert [i["output"] for i in sent[1::2]] == ["slept 0.8", "slept 0.8", "quick"]


def test_allowed_tools_filters_the_listing_and_the_offer(mcp_fixture_server: McpTestServer) -> None:
    key = "only echo"
    up = Upstream({key: [text_round("no call")]})
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        body = post(url, {"model": "tiny", "input": key, "tools": [
            mcp_tool("calc", mcp_fixture_server, allowed_tools=["echo", "fail"])]}).json()
        as_filter = post(url, {"model": "tiny", "input": key, "tools": [
            mcp_tool("calc", mcp_fixture_server, allowed_tools={"tool_names": ["add"]})]}).json()
    assert [t["name"] for t in body["output"][0]["tools"]] == ["echo", "fail"]
    assert [t["name"] for t in up.bodies[0]["tools"]] == [mcp_name("calc", "echo"), mcp_name("calc", "fail")]
    assert [t["name"] for t in as_filter["output"][0]["tools"]] == ["add"]
    assert [t["name"] for t in up.bodies[1]["tools"]] == [mcp_name("calc", "add")]


@pytest.mark.parametrize("approve", [True, False], ids=["approved", "denied"])
def test_require_approval_through_previous_response_id(mcp_fixture_server: McpTestServer, tmp_path: Path,
                                                       list_calls: list[str], approve: bool) -> None:
    key = f"approval {approve}"
    up = Upstream({key: [call_round("calc", ("add", {"a": 20, "b": 22})), echo_output]})
    tools = [mcp_tool("calc", mcp_fixture_server, require_approval="always")]
    before = len(mcp_fixture_server.calls())
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        with sdk(url).responses.stream(model="tiny", input=key, tools=tools) as s:  # type: ignore[arg-type]
            kinds = [e.type for e in s]
            r1 = s.get_final_response().model_dump(mode="json")
        assert kinds[-1] == "response.completed" and r1["status"] == "completed", r1
        assert [i["type"] for i in r1["output"]] == ["mcp_list_tools", "mcp_approval_request"]
        assert not any(k.startswith(("response.mcp_call", "response.function_call")) for k in kinds)
        asked = r1["output"][1]
        assert asked["id"].startswith("mcpr_") and json.loads(asked["arguments"]) == {"a": 20, "b": 22}
        assert new_calls(mcp_fixture_server, before) == []  # nothing ran before the answer
        events = stream(url, {"model": "tiny", "previous_response_id": r1["id"], "tools": tools, "input": [
            {"type": "mcp_approval_response", "approval_request_id": asked["id"], "approve": approve,
             "reason": "not today"}]})
        stored = httpx.get(f"{url}/v1/responses/{events[-1]['response']['id']}").json()
    r2 = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and stored["output"] == r2["output"]
    assert list_calls == ["calc"]  # the listing is reused from the first response
    ran = new_calls(mcp_fixture_server, before)
    told = up.bodies[1]["input"][-1]
    assert told["type"] == "function_call_output"
    if approve:
        assert [(c["tool"], c["arguments"]) for c in ran] == [("add", {"a": 20, "b": 22})]
        assert [i["type"] for i in r2["output"]] == ["mcp_call", "message"]
        call = r2["output"][0]
        assert call["approval_request_id"] == asked["id"] and call["output"] == "42" and call["status"] == "completed"
        assert told["output"] == "42" and r2["output"][1]["content"][0]["text"] == "The tool said: 42"
        kinds = [e["type"] for e in events]
        assert kinds.index("response.mcp_call.completed") < kinds.index("response.output_text.delta")
    else:
        assert ran == []
        assert [i["type"] for i in r2["output"]] == ["message"]
        assert "denied" in told["output"] and "not today" in told["output"]


# --- failures ---------------------------------------------------------------------------------------------


def test_a_failing_tool_is_told_to_the_model_and_the_loop_goes_on(mcp_fixture_server: McpTestServer) -> None:
    key, again = "fail please", "fail again"
    script = [call_round("calc", ("fail", {"message": "the disk is on fire"})), echo_output]
    up = Upstream({key: script, again: script})
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        events = stream(url, {"model": "tiny", "input": key, "tools": [mcp_tool("calc", mcp_fixture_server)]})
    kinds = [e["type"] for e in events]
    assert "response.mcp_call.failed" in kinds and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    call = final["output"][1]
    assert call["status"] == "failed" and call["output"] is None
    assert call["error"]["type"] == "mcp_tool_execution_error"
    # the SDK's server reports the exception without its message: "Error executing tool fail"
    [block] = call["error"]["content"]
    assert block["type"] == "text" and "fail" in block["text"]
    told = up.bodies[1]["input"][-1]["output"]
    assert told == f"The tool reported an error: {block['text']}"
    assert final["output"][2]["content"][0]["text"] == f"The tool said: {told}"
    # the SDK's strict stream helper takes the failed call too (its McpCall error shape)
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url, \
            sdk(url).responses.stream(model="tiny", input=again, tools=[mcp_tool("calc", mcp_fixture_server)]) as s:  # type: ignore[arg-type]
        assert "response.mcp_call.failed" in [e.type for e in s]
        parsed = s.get_final_response().output[1]
    assert parsed.type == "mcp_call" and parsed.status == "failed" and parsed.error is not None
    assert parsed.error.type == "mcp_tool_execution_error"  # type: ignore[union-attr]


def test_an_unreachable_server_is_reported_and_the_response_goes_on(mcp_fixture_server: McpTestServer) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "unreachable"
    up = Upstream({key: [call_round("calc", ("add", {"a": 1, "b": 2})), echo_output]})
    dead = {"type": "mcp", "server_label": "dead", "server_url": f"http://127.0.0.1:{port}/mcp",
            "require_approval": "never"}
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        started = time.monotonic()
        events = stream(url, {"model": "tiny", "input": key, "tools": [dead, mcp_tool("calc", mcp_fixture_server)]})
        elapsed = time.monotonic() - started
    kinds = [e["type"] for e in events]
    assert kinds.count("response.mcp_list_tools.failed") == 1 and kinds[-1] == "response.completed"
    out = events[-1]["response"]["output"]
    assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_list_tools", "mcp_call", "message"]
    failed = next(i for i in out if i["server_label"] == "dead")
    assert failed["error"] and failed["tools"] == []
    assert out[2]["output"] == "3"
    assert not any(t["name"].startswith("mcp__dead__") for t in up.bodies[0]["tools"])
    assert elapsed < 10


def test_a_slow_tool_times_out_and_other_requests_are_served_meanwhile(mcp_fixture_server: McpTestServer) -> None:
    up = Upstream({"slow": [call_round("calc", ("sleep", {"seconds": 3})), echo_output],
                   "quick": [call_round("calc", ("add", {"a": 7, "b": 8})), echo_output]})
    tools = [mcp_tool("calc", mcp_fixture_server)]
    before = len(mcp_fixture_server.calls())
    slow: dict[str, Any] = {}
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK, mcp_call_timeout=1.5) as url:

        def run_slow() -> None:
            started = time.monotonic()
            slow["events"] = stream(url, {"model": "tiny", "input": "slow", "tools": tools})
            slow["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=run_slow)
        thread.start()
        deadline = time.monotonic() + 10
        while not any(c["tool"] == "sleep" for c in new_calls(mcp_fixture_server, before)):
            assert time.monotonic() < deadline, "the slow call never reached the server"
            time.sleep(0.02)
        started = time.monotonic()
        quick = post(url, {"model": "tiny", "input": "quick", "tools": tools}).json()  # same server, same pool
        quick_seconds = time.monotonic() - started
        assert thread.is_alive()  # the slow call is still running: the quick one did not wait for it
        thread.join(15)
    assert quick["output"][1]["output"] == "15" and quick_seconds < 1.5
    events = slow["events"]
    assert events[-1]["type"] == "response.completed"
    call = events[-1]["response"]["output"][1]
    assert call["status"] == "failed" and call["error"]["type"] == "http_error" and call["error"]["code"] == 504
    assert 1.4 < slow["seconds"] < 3.0  # bounded by --mcp-call-timeout, not by the tool
    assert up.bodies_for("slow")[1]["input"][-1]["output"] == \
        "The tool call failed (http_error): the MCP server did not answer in time"


def test_a_server_outside_the_allowlist_is_a_400_and_nothing_is_contacted(
        mcp_fixture_server: McpTestServer, list_calls: list[str], call_calls: list[str]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # would see any connection attempt
    listener.setblocking(False)
    port = listener.getsockname()[1]
    fixture_port = int(mcp_fixture_server.base_url.rsplit(":", 1)[1])
    up = Upstream({"x": [text_round("never")]})
    before = len(mcp_fixture_server.calls())
    outsider = {"type": "mcp", "server_label": "out", "server_url": f"http://127.0.0.1:{port}/mcp",
                "require_approval": "never"}
    by_name = {"type": "mcp", "server_label": "byname", "require_approval": "never",
               "server_url": mcp_fixture_server.url.replace("127.0.0.1", "localhost")}
    try:
        with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=(f"127.0.0.1:{fixture_port}",)) \
                as url:
            first = post(url, {"model": "tiny", "input": "x", "tools": [outsider]})
            second = post(url, {"model": "tiny", "input": "x", "stream": True,
                                "tools": [mcp_tool("calc", mcp_fixture_server), by_name]})
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    for r, param in ((first, "tools[0].server_url"), (second, "tools[1].server_url")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "mcp_server_not_allowed" and error["param"] == param
        assert error["type"] == "invalid_request_error"
    assert up.requests == [] and list_calls == [] and call_calls == []
    assert new_calls(mcp_fixture_server, before) == []


# --- configured servers and credentials -------------------------------------------------------------------


def test_a_label_only_tool_uses_the_servers_file(mcp_fixture_server: McpTestServer, tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"ops": {
        "url": mcp_fixture_server.url, "headers": {"X-Api-Key": "cfg-key-0123456789"},
        "allowed_tools": ["add", "echo"], "require_approval": "never"}}}))
    key = "servers file"
    up = Upstream({key: [call_round("ops", ("echo", {"text": "configured"})), echo_output]})
    before = len(mcp_fixture_server.calls())
    # No allowlist at all: the servers file's hosts count as allowed.
    with running_gateway(transport=httpx.MockTransport(up), mcp_servers_file=str(path)) as url:
        events = stream(url, {"model": "tiny", "input": key, "tools": [{"type": "mcp", "server_label": "ops"}]})
        unknown = post(url, {"model": "tiny", "input": key, "tools": [{"type": "mcp", "server_label": "nope"}]})
    final = events[-1]["response"]
    assert [t["name"] for t in final["output"][0]["tools"]] == ["add", "echo"]  # the file's allowed_tools
    assert final["output"][1]["output"] == "configured"  # the file's require_approval: never
    [recorded] = new_calls(mcp_fixture_server, before)
    assert recorded["headers"]["x-api-key"] == "cfg-key-0123456789"
    assert "cfg-key-0123456789" not in json.dumps(events)
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "mcp_server_not_allowed"
    assert unknown.json()["error"]["param"] == "tools[0].server_url"


def test_credentials_reach_the_server_and_nothing_else(mcp_fixture_server: McpTestServer, tmp_path: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    secret, token = "hdr-5ecret-7f3a9c", "tok-0b5e7a1d2c"
    tool = mcp_tool("calc", mcp_fixture_server, headers={"X-Secret": secret}, authorization=token)
    up = Upstream({"creds streamed": [call_round("calc", ("add", {"a": 5, "b": 6})), echo_output],
                   "creds": [call_round("calc", ("add", {"a": 1, "b": 6})), echo_output, text_round("again")]})
    before = len(mcp_fixture_server.calls())
    db = tmp_path / "r.db"
    with structlog.testing.capture_logs() as logs, \
            running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK,
                            store=SqliteResponseStore(db)) as url:
        raw = post(url, {"model": "tiny", "input": "creds streamed", "tools": [tool], "stream": True})
        plain = post(url, {"model": "tiny", "input": "creds", "tools": [tool]})
        ids = [sse_events(raw.content)[-1]["response"]["id"], plain.json()["id"]]
        fetched = [httpx.get(f"{url}/v1/responses/{i}").text for i in ids]
        items = [httpx.get(f"{url}/v1/responses/{i}/input_items").text for i in ids]
        # a continuation echoes the tools again
        follow = post(url, {"model": "tiny", "input": "creds", "previous_response_id": ids[1], "tools": [tool]})
    assert plain.status_code == 200 and follow.status_code == 200
    recorded = new_calls(mcp_fixture_server, before)
    assert len(recorded) >= 2
    for call in recorded:
        assert call["headers"]["x-secret"] == secret and call["headers"]["authorization"] == f"Bearer {token}"
    # the tool is echoed, without its credentials
    echoed = plain.json()["tools"][0]
    assert echoed["server_label"] == "calc" and "headers" not in echoed and "authorization" not in echoed
    files = sorted(tmp_path.glob("r.db*"))
    assert db in files
    places = {"stream": raw.content.decode(), "body": plain.text, "follow": follow.text, "get": "".join(fetched),
              "input_items": "".join(items), "logs": repr(logs), "store": b"".join(f.read_bytes() for f in files),
              "upstream": json.dumps(up.requests)}
    captured = capfd.readouterr()
    places["stdout"], places["stderr"] = captured.out, captured.err
    for where, text in places.items():
        for value in (secret, token, "Bearer"):
            needle: str | bytes = value.encode() if isinstance(text, bytes) else value
            assert needle not in text, f"{value!r} leaked into {where}"
    assert any(e.get("event") == "mcp_call" and e.get("server_label") == "calc" for e in logs)


# --- bounds and reuse -------------------------------------------------------------------------------------


def test_the_round_bound_withholds_the_tools_for_one_last_round(mcp_fixture_server: McpTestServer) -> None:
    key = "keep calling"
    up = Upstream({key: [call_round("calc", ("add", {"a": 1, "b": 2}))]})  # calls add every round
    before = len(mcp_fixture_server.calls())
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK, max_tool_rounds=1) as url:
        body = post(url, {"model": "tiny", "input": key, "tools": [mcp_tool("calc", mcp_fixture_server)]}).json()
    assert body["status"] == "completed"
    assert len(new_calls(mcp_fixture_server, before)) == 1 and len(up.bodies) == 2
    assert up.bodies[1].get("tool_choice") == "none" and not up.bodies[1].get("tools")
    calls = [i for i in body["output"] if i["type"] == "mcp_call"]
    assert [c["status"] for c in calls] == ["completed", "failed"]
    assert calls[0]["output"] == "3" and "tool-round" in calls[1]["error"]["content"][0]["text"]


@pytest.mark.parametrize("how", ["previous_response_id", "history_sent"])
def test_a_continuation_reuses_the_listing(mcp_fixture_server: McpTestServer, tmp_path: Path,
                                           list_calls: list[str], how: str) -> None:
    key = f"reuse {how}"
    up = Upstream({key: [call_round("calc", ("add", {"a": 2, "b": 2})), echo_output,
                         call_round("calc", ("add", {"a": 3, "b": 3})), echo_output]})
    tools = [mcp_tool("calc", mcp_fixture_server)]
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        r1 = post(url, {"model": "tiny", "input": key, "tools": tools}).json()
        follow_up = {"role": "user", "content": "and 3 + 3?"}
        if how == "previous_response_id":
            second = {"input": [follow_up], "previous_response_id": r1["id"]}
        else:  # the client keeps the conversation itself: the first turn's output goes back as input
            second = {"input": [{"role": "user", "content": key}, *r1["output"], follow_up], "store": False}
        r2 = post(url, {"model": "tiny", "tools": tools, **second}).json()
    assert [i["type"] for i in r1["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert [i["type"] for i in r2["output"]] == ["mcp_call", "message"], r2  # no new mcp_list_tools item
    assert r2["output"][0]["output"] == "6"
    assert list_calls == ["calc"]  # the server was listed once
    # the model is still offered the tools, from the reused listing, and sees the first call as a function call
    third = up.bodies[2]
    assert mcp_name("calc", "add") in {t["name"] for t in third["tools"]}
    sent = [(i.get("type"), i.get("role")) for i in third["input"]]
    assert sent[1:3] == [("function_call", None), ("function_call_output", None)], sent
    assert third["input"][2]["output"] == "4" and not any(t == "mcp_list_tools" for t, _ in sent)


# --- clients and upstream modes ---------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_hosted_mcp_tool(mcp_fixture_server: McpTestServer, streamed: bool) -> None:
    from agents import Agent, HostedMCPTool, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    key = f"agents {streamed}: add 19 and 23"
    up = Upstream({key: [call_round("calc", ("add", {"a": 19, "b": 23})), echo_output]})
    before = len(mcp_fixture_server.calls())
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        agent = Agent(name="calc", instructions="Use the tools.", model=OpenAIResponsesModel("tiny", client),
                      tools=[HostedMCPTool(tool_config={"type": "mcp", "server_label": "calc",
                                                        "server_url": mcp_fixture_server.url,
                                                        "require_approval": "never"})])

        async def run() -> Any:
            config = RunConfig(tracing_disabled=True)
            if not streamed:
                return await Runner.run(agent, key, run_config=config)
            result = Runner.run_streamed(agent, key, run_config=config)
            async for _ in result.stream_events():
                pass
            return result

        async def run_and_close() -> Any:
            try:
                return await run()
            finally:
                await client.close()

        result = asyncio.run(run_and_close())
    assert result.final_output == "The tool said: 42"
    assert [(c["tool"], c["arguments"]) for c in new_calls(mcp_fixture_server, before)] == [
        ("add", {"a": 19, "b": 23})]
    kinds = [type(i).__name__ for i in result.new_items]
    assert "MCPListToolsItem" in kinds and "ToolCallItem" in kinds and kinds[-1] == "MessageOutputItem"
    assert mcp_name("calc", "add") in {t["name"] for t in up.bodies[0]["tools"]}


def test_agents_sdk_hosted_mcp_tool_with_approval(mcp_fixture_server: McpTestServer,
                                                  list_calls: list[str]) -> None:
    """The Agents SDK answers the approval request itself and sends the whole history back (no stored chain)."""
    from agents import Agent, HostedMCPTool, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    key = "agents approval: add 30 and 12"
    up = Upstream({key: [call_round("calc", ("add", {"a": 30, "b": 12})), echo_output]})
    asked: list[Any] = []
    before = len(mcp_fixture_server.calls())

    def on_approval(request: Any) -> dict[str, Any]:
        asked.append(request.data)
        assert new_calls(mcp_fixture_server, before) == []  # not run before the answer
        return {"approve": True}

    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        agent = Agent(name="calc", model=OpenAIResponsesModel("tiny", client),
                      tools=[HostedMCPTool(tool_config={"type": "mcp", "server_label": "calc",
                                                        "server_url": mcp_fixture_server.url,
                                                        "require_approval": "always"},
                                           on_approval_request=on_approval)])

        async def run() -> Any:
            try:
                return await Runner.run(agent, key, run_config=RunConfig(tracing_disabled=True))
            finally:
                await client.close()

        result = asyncio.run(run())
    assert result.final_output == "The tool said: 42"
    assert [(a.name, json.loads(a.arguments)) for a in asked] == [("add", {"a": 30, "b": 12})]
    assert [(c["tool"], c["arguments"]) for c in new_calls(mcp_fixture_server, before)] == [
        ("add", {"a": 30, "b": 12})]
    assert [type(i).__name__ for i in result.new_items] == [
        "MCPListToolsItem", "MCPApprovalRequestItem", "MCPApprovalResponseItem", "ToolCallItem", "MessageOutputItem"]
    assert list_calls == ["calc"]  # the second request reused the mcp_list_tools item the SDK sent back
    assert up.bodies[1]["input"][-1] == {"type": "function_call_output", "output": "42",
                                         "call_id": up.bodies[1]["input"][-2]["call_id"]}


def test_chat_upstream_mode(mcp_fixture_server: McpTestServer) -> None:
    args = json.dumps({"a": 4, "b": 5})

    def answer(body: dict[str, Any]) -> ChatStream:
        last = body["messages"][-1]
        assert last["role"] == "tool", last
        return ChatStream().text(["The tool ", "said: ", str(last["content"])]).finish("stop")

    def call(_: dict[str, Any]) -> ChatStream:
        return ChatStream().call(0, f"chatcmpl-tool-{_hex()}", mcp_name("calc", "add"),
                                 [args[:5], args[5:]]).finish("tool_calls")

    keys = {"chat streamed: 4 + 5?": True, "chat: 4 + 5?": False}
    up = Upstream({key: [call, answer] for key in keys})
    before = len(mcp_fixture_server.calls())
    tools = [mcp_tool("calc", mcp_fixture_server)]
    with running_gateway(transport=httpx.MockTransport(up), mcp_allowed_hosts=LOOPBACK, upstream_api="chat") as url:
        finals = [stream(url, {"model": "tiny", "input": key, "tools": tools})[-1]["response"] if streamed
                  else post(url, {"model": "tiny", "input": key, "tools": tools}).json()
                  for key, streamed in keys.items()]
    assert {p for p, _ in up.requests} == {"/v1/chat/completions"} and len(up.requests) == 4
    for final in finals:
        assert final["status"] == "completed", final
        assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
        assert final["output"][1]["output"] == "9" and json.loads(final["output"][1]["arguments"]) == {"a": 4, "b": 5}
        assert final["output"][2]["content"][0]["text"] == "The tool said: 9"
    assert [(c["tool"], c["arguments"]) for c in new_calls(mcp_fixture_server, before)] == [
        ("add", {"a": 4, "b": 5})] * 2
    first, second = up.bodies[:2]
    assert mcp_name("calc", "add") in {t["function"]["name"] for t in first["tools"]}
    assert second["messages"][-2]["role"] == "assistant"
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == mcp_name("calc", "add")
    assert second["messages"][-1]["tool_call_id"] == second["messages"][-2]["tool_calls"][0]["id"]
