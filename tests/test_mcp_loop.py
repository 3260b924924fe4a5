"""The tool loop with gateway-executed MCP tools, against a scripted upstream.

The upstream is SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py): round 1 calls the listed MCP tool
as a function (under the gateway's name for it), round 2 answers in text. The MCP side here is an in-process
executor (the loop's contract); tests/test_mcp_servers.py runs the same flows against real MCP servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.store import SqliteResponseStore
from gateway.translate.mcp_items import McpCallOutcome, mcp_name
from tests.invariants import TERMINALS
from tests.support import running_gateway, sse_events
from tests.vllm_frames import VllmStream

ADD = {"name": "add", "description": "Add two integers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}, "annotations": None}
ECHO = {"name": "echo", "description": "Echo text.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}, "annotations": None}
CALC = {"type": "mcp", "server_label": "calc", "server_url": "http://mcp.test/mcp", "require_approval": "never",
        "headers": {"X-Secret": "s3cret-header"}}


class FakeExecutor:
    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub

    async def list_tools(self, label: str) -> list[dict[str, Any]]:
        self.hub.listed.append(label)
        if label == "broken":
            raise ConnectionError("unreachable")
        return [ADD, ECHO]

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any]) -> McpCallOutcome:
        self.hub.calls.append((label, name, arguments))
        if name == "add":
            return McpCallOutcome(output=str(arguments["a"] + arguments["b"]))
        if name == "echo" and arguments.get("text") == "fail":
            return McpCallOutcome(error={"type": "mcp_tool_execution_error",
                                         "content": [{"type": "text", "text": "echo refused"}]})
        return McpCallOutcome(output=str(arguments.get("text")))


class FakeHub:
    def __init__(self) -> None:
        self.listed: list[str] = []
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def bind(self, ctx: Any, body: Any, owner: str | None = None) -> tuple[Any, FakeExecutor]:
        return ctx, FakeExecutor(self)


class Upstream:
    """Each /v1/responses round: the next scripted answer; every request body is kept."""

    def __init__(self, rounds: list[VllmStream]) -> None:
        self.rounds = rounds
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        stream = self.rounds[min(len(self.bodies), len(self.rounds)) - 1]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.body())


def call_round(*calls: tuple[str, dict[str, Any]]) -> VllmStream:
    s = VllmStream(response_id=f"resp_r{len(calls)}").start()
    for i, (name, args) in enumerate(calls):
        s.call(f"fc_{i:016x}", f"call_{i}", mcp_name("calc", name), [json.dumps(args)])
    return s.complete()


def text_round(text: str = "The sum is 5.") -> VllmStream:
    return VllmStream(response_id="resp_text").start().message("msg_00000000000000e1", [text]).complete()


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def test_list_call_and_answer_streamed_through_the_sdks_strict_stream() -> None:
    hub, up = FakeHub(), Upstream([call_round(("add", {"a": 2, "b": 3})), text_round()])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model="tiny", input="What is 2+3?", tools=[CALC]) as stream:  # type: ignore[list-item]
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
    assert [o.type for o in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, _message = final.output
    assert [t.name for t in listing.tools] == ["add", "echo"]  # type: ignore[union-attr]
    assert call.name == "add" and call.server_label == "calc" and call.output == "5"  # type: ignore[union-attr]
    assert call.id.startswith("mcp_") and call.status == "completed"  # type: ignore[union-attr]
    assert json.loads(call.arguments) == {"a": 2, "b": 3}  # type: ignore[union-attr]
    # one response: one created, one terminal; the MCP events in OpenAI's order
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    expected = ["response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
                "response.mcp_call.in_progress", "response.mcp_call.completed", "response.output_text.delta"]
    positions = [kinds.index(k) for k in expected]
    assert positions == sorted(positions)
    assert "response.function_call_arguments.delta" not in kinds  # gateway-owned frames never shown
    assert hub.calls == [("calc", "add", {"a": 2, "b": 3})]
    # round 2 got the conversation plus the call and its output, in function form
    second = up.bodies[1]["input"]
    assert second[-2]["type"] == "function_call" and second[-2]["name"] == mcp_name("calc", "add")
    assert second[-1] == {"type": "function_call_output", "call_id": second[-2]["call_id"], "output": "5"}
    assert [t["name"] for t in up.bodies[0]["tools"]] == [mcp_name("calc", "add"), mcp_name("calc", "echo")]
    # usage is summed over the two rounds; the client's tool is echoed without its credentials
    assert final.usage is not None and final.usage.input_tokens == 240 and final.usage.output_tokens == 80
    assert "s3cret-header" not in json.dumps(final.model_dump())


def test_non_streamed_two_round_loop_with_contiguous_output() -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 1})), call_round(("echo", {"text": "hi"})), text_round("ok")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        r = post(url, {"model": "tiny", "input": "go", "tools": [CALC]})
    body = r.json()
    assert r.status_code == 200, body
    assert [i["type"] for i in body["output"]] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert [i["output"] for i in body["output"][1:3]] == ["2", "hi"]
    assert len(up.bodies) == 3 and body["status"] == "completed"
    assert body["usage"]["total_tokens"] == 3 * 160


def test_allowed_tools_filters_the_listing_and_what_the_model_is_offered() -> None:
    hub, up = FakeHub(), Upstream([text_round("no tools needed")])
    tool = {**CALC, "allowed_tools": ["echo"]}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        body = post(url, {"model": "tiny", "input": "x", "tools": [tool]}).json()
    assert [t["name"] for t in body["output"][0]["tools"]] == ["echo"]
    assert [t["name"] for t in up.bodies[0]["tools"]] == [mcp_name("calc", "echo")]


def test_a_failing_tool_is_told_to_the_model_and_the_loop_goes_on() -> None:
    hub, up = FakeHub(), Upstream([call_round(("echo", {"text": "fail"})), text_round("sorry")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        r = post(url, {"model": "tiny", "input": "x", "tools": [CALC], "stream": True})
    events = sse_events(r.content)
    failed = [e for e in events if e["type"] == "response.mcp_call.failed"]
    assert len(failed) == 1
    final = events[-1]["response"]
    call = final["output"][1]
    assert call["status"] == "failed" and call["error"]["type"] == "mcp_tool_execution_error"
    assert "echo refused" in up.bodies[1]["input"][-1]["output"]
    assert final["output"][-1]["type"] == "message" and events[-1]["type"] == "response.completed"


def test_an_unlistable_server_is_reported_and_the_response_goes_on_without_it() -> None:
    hub, up = FakeHub(), Upstream([text_round("fine")])
    broken = {"type": "mcp", "server_label": "broken", "server_url": "http://mcp.test/x", "require_approval": "never"}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        r = post(url, {"model": "tiny", "input": "x", "tools": [broken, CALC], "stream": True})
    events = sse_events(r.content)
    kinds = [e["type"] for e in events]
    assert "response.mcp_list_tools.failed" in kinds and "response.mcp_list_tools.completed" in kinds
    out = events[-1]["response"]["output"]
    assert out[0]["server_label"] == "broken" and out[0]["error"] and out[0]["tools"] == []
    assert [t["name"] for t in up.bodies[0]["tools"]] == [mcp_name("calc", "add"), mcp_name("calc", "echo")]


def test_the_round_bound_runs_one_last_round_without_tools() -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 2}))] * 3 + [text_round("done")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub, max_tool_rounds=2) as url:
        body = post(url, {"model": "tiny", "input": "x", "tools": [CALC]}).json()
    assert len(hub.calls) == 2 and len(up.bodies) == 3
    assert up.bodies[2].get("tool_choice") == "none" and "tools" not in up.bodies[2]
    # the last round called a tool anyway (withheld): shown, but not run
    assert body["output"][-1]["status"] in ("failed", "completed")


def test_max_tool_calls_caps_the_calls_run() -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})), text_round("done")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        body = post(url, {"model": "tiny", "input": "x", "tools": [CALC], "max_tool_calls": 1}).json()
    assert len(hub.calls) == 1
    calls = [i for i in body["output"] if i["type"] == "mcp_call"]
    assert [c["status"] for c in calls] == ["completed", "failed"]
    assert "max_tool_calls" in calls[1]["error"]["content"][0]["text"]
    assert up.bodies[1].get("tool_choice") == "none"


def test_a_round_with_a_client_tool_ends_the_response_after_running_the_gateway_calls() -> None:
    hub = FakeHub()
    s = VllmStream().start()
    s.call("fc_0000000000000001", "call_1", mcp_name("calc", "add"), [json.dumps({"a": 5, "b": 5})])
    s.call("fc_0000000000000002", "call_2", "get_weather", [json.dumps({"city": "Paris"})])
    up = Upstream([s.complete()])
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        r = post(url, {"model": "tiny", "input": "x", "tools": [CALC, weather], "stream": True})
    events = sse_events(r.content)
    assert [e["type"] for e in events].count("response.completed") == 1
    out = events[-1]["response"]["output"]
    assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_call", "function_call"]
    assert out[1]["output"] == "10" and len(up.bodies) == 1


@pytest.mark.parametrize("approve", [True, False])
def test_approval_flow_through_previous_response_id(tmp_path: Path, approve: bool) -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 20, "b": 22})), text_round("42 it is")])
    needs = {**CALC, "require_approval": "always"}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        r1 = post(url, {"model": "tiny", "input": "add", "tools": [needs]}).json()
        request = r1["output"][-1]
        assert request["type"] == "mcp_approval_request" and request["id"].startswith("mcpr_")
        assert json.loads(request["arguments"]) == {"a": 20, "b": 22} and r1["status"] == "completed"
        assert hub.calls == []
        r2 = post(url, {"model": "tiny", "previous_response_id": r1["id"], "tools": [needs], "input": [
            {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": approve,
             "reason": "not today"}]}).json()
        bad = post(url, {"model": "tiny", "previous_response_id": r1["id"], "tools": [needs], "input": [
            {"type": "mcp_approval_response", "approval_request_id": "mcpr_nope", "approve": True}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].approval_request_id"
    assert r2["status"] == "completed", r2
    # the listing is reused from the conversation: not listed again, no new mcp_list_tools item
    assert hub.listed == ["calc"]
    sent = up.bodies[1]["input"]
    if approve:
        assert hub.calls == [("calc", "add", {"a": 20, "b": 22})]
        call = r2["output"][0]
        assert call["type"] == "mcp_call" and call["approval_request_id"] == request["id"] and call["output"] == "42"
        assert sent[-1]["type"] == "function_call_output" and sent[-1]["output"] == "42"
    else:
        assert hub.calls == []
        assert [i["type"] for i in r2["output"]] == ["message"]
        assert sent[-1]["type"] == "function_call_output" and "denied" in sent[-1]["output"]
        assert "not today" in sent[-1]["output"]


def test_terminal_is_unique_and_indexes_contiguous_across_rounds() -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 1})), text_round("ok")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        events = sse_events(post(url, {"model": "tiny", "input": "x", "tools": [CALC], "stream": True}).content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events if e["type"] in TERMINALS] == ["response.completed"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(added)))


def test_parallel_tool_calls_false_runs_one_call_per_round() -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})),
                   call_round(("add", {"a": 3, "b": 4})), text_round("done")])
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        body = post(url, {"model": "tiny", "input": "x", "tools": [CALC], "parallel_tool_calls": False}).json()
    assert hub.calls == [("calc", "add", {"a": 1, "b": 2}), ("calc", "add", {"a": 3, "b": 4})]
    assert [i["type"] for i in body["output"]] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert [i["output"] for i in body["output"][1:3]] == ["3", "7"]


def test_an_approved_call_goes_upstream_once_across_later_rounds(tmp_path: Path) -> None:
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 1, "b": 1})), call_round(("echo", {"text": "e"})), text_round("ok")])
    tool = {**CALC, "require_approval": {"always": {"tool_names": ["add"]}, "never": {"tool_names": ["echo"]}}}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        r1 = post(url, {"model": "tiny", "input": "go", "tools": [tool]}).json()
        request = r1["output"][-1]
        assert request["type"] == "mcp_approval_request"
        r2 = post(url, {"model": "tiny", "previous_response_id": r1["id"], "tools": [tool], "input": [
            {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}]}).json()
    assert [c[1] for c in hub.calls] == ["add", "echo"]
    assert [i["type"] for i in r2["output"]] == ["mcp_call", "mcp_call", "message"]
    # round 2 of the second response: the approved call and the echo call, each exactly once
    third = up.bodies[2]["input"]
    calls = [i["call_id"] for i in third if i.get("type") == "function_call"]
    assert len(calls) == len(set(calls)) == 2


def test_an_approval_resent_with_the_full_history_does_not_run_the_call_again() -> None:
    """store: false: the client sends the whole conversation back each turn, old approvals included."""
    hub = FakeHub()
    up = Upstream([call_round(("add", {"a": 2, "b": 2})), text_round("four"), text_round("bye")])
    needs = {**CALC, "require_approval": "always"}
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub) as url:
        history: list[Any] = [{"type": "message", "role": "user", "content": "add"}]
        r1 = post(url, {"model": "tiny", "store": False, "input": history, "tools": [needs]}).json()
        history += r1["output"]
        history.append({"type": "mcp_approval_response", "approval_request_id": r1["output"][-1]["id"],
                        "approve": True})
        r2 = post(url, {"model": "tiny", "store": False, "input": history, "tools": [needs]}).json()
        history += r2["output"] + [{"type": "message", "role": "user", "content": "thanks"}]
        r3 = post(url, {"model": "tiny", "store": False, "input": history, "tools": [needs]}).json()
    assert hub.calls == [("calc", "add", {"a": 2, "b": 2})]  # once, on the turn that answered the request
    assert r2["output"][0]["type"] == "mcp_call" and r3["status"] == "completed"
    assert [i["type"] for i in r3["output"]] == ["message"]
