"""The client-executed built-in tools (``apply_patch``, ``shell``, ``local_shell``): offered to vLLM as functions,
returned as OpenAI's items (the newest openai SDK's models are the judges), their history sent back as function
calls and outputs.

The upstream streams here are SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py, built from the recorded
cassettes); the tiny model cannot be scripted to write a given patch.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    ResponseApplyPatchToolCall,
    ResponseFunctionShellToolCall,
    ResponseInputItem,
)
from openai.types.responses.response import Response
from openai.types.responses.response_output_item import LocalShellCall
from pydantic import TypeAdapter

from gateway.enforce.validate import check_pinned_output
from gateway.errors import InvalidRequest
from gateway.protocol.events import ClientEvent, UpstreamEvent
from gateway.protocol.sse import SseParser, encode_events
from gateway.runtime import new_id
from gateway.translate.builtin_tools import PatchStream
from gateway.translate.restore import build_request_state, restore_output
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.translator import FunctionSseTranslator
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events
from tests.test_js_clients import ScriptedVllm, Upstream
from tests.vllm_frames import VllmStream, args_deltas

TOOLS = [{"type": "apply_patch"}, {"type": "shell", "environment": {"type": "local"}}, {"type": "local_shell"}]
REQUEST = {"model": "tiny", "input": "edit", "tools": TOOLS}
CREATE = {"operation": {"type": "create_file", "path": "notes/hello.txt",
                        "diff": '+Hello, "world"!\n+\ttabbed \\ backslash \u00e9 \U0001f600\n'}}


def translate(body: bytes, request: dict[str, Any] = REQUEST, cuts: list[int] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    state = build_request_state(request, resolve_tool_context(request), response_id="resp_1", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    parser = SseParser()
    out: list[ClientEvent] = []
    prev = 0
    for p in [*sorted({c % (len(body) + 1) for c in cuts}), len(body)]:
        for event, data in parser.feed(body[prev:p]):
            out += tr.feed(UpstreamEvent(event, data))
        prev = p
    for event, data in parser.close():
        out += tr.feed(UpstreamEvent(event, data))
    out += tr.finish()
    return sse_events(encode_events(out))


def sdk_response(resp: dict[str, Any]) -> Response:
    """The SDK's strict model of a response; usage left out (its cache_write_tokens is issue 19's part 4, another
    change)."""
    return Response.model_validate({**resp, "usage": None}, strict=True)


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# --- offered upstream ---------------------------------------------------------------------------------------


def test_each_tool_is_offered_to_vllm_as_a_strict_function_mirroring_its_payload() -> None:
    up = build_upstream_request(REQUEST, resolve_tool_context(REQUEST))
    by_name = {t["name"]: t for t in up["tools"]}
    assert set(by_name) == {"apply_patch", "shell", "local_shell"}
    assert all(t["type"] == "function" and t["strict"] is True for t in up["tools"])
    op = by_name["apply_patch"]["parameters"]["properties"]["operation"]
    assert list(op["properties"]) == ["type", "path", "diff"]  # type and path first: the call opens as it streams
    assert op["properties"]["type"]["enum"] == ["create_file", "update_file", "delete_file"]
    assert set(by_name["shell"]["parameters"]["properties"]["action"]["properties"]) == {
        "commands", "timeout_ms", "max_output_length"}
    assert set(by_name["local_shell"]["parameters"]["properties"]["action"]["properties"]) == {
        "command", "env", "timeout_ms", "working_directory", "user"}
    assert up["tool_choice"] == "auto"


@pytest.mark.parametrize(("choice", "upstream"), [
    ({"type": "apply_patch"}, {"type": "function", "name": "apply_patch"}),
    ({"type": "shell"}, {"type": "function", "name": "shell"}),
])
def test_tool_choice_naming_a_builtin_pins_its_function(choice: dict[str, Any], upstream: dict[str, Any]) -> None:
    body = {**REQUEST, "tool_choice": choice}
    ctx = resolve_tool_context(body)
    assert build_upstream_request(body, ctx)["tool_choice"] == upstream
    assert [i.kind for i in ctx.pinned_tools] == [choice["type"]]


def test_allowed_tools_can_name_a_builtin() -> None:
    body = {**REQUEST, "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "shell"}]}}
    up = build_upstream_request(body, resolve_tool_context(body))
    assert [t["name"] for t in up["tools"]] == ["shell"] and up["tool_choice"] == "required"


@pytest.mark.parametrize("name", ["apply_patch", "shell", "local_shell"])
def test_a_client_function_with_a_builtins_name_is_a_400(name: str) -> None:
    body = {**REQUEST, "tools": [*TOOLS, {"type": "function", "name": name, "parameters": {"type": "object"}}]}
    with pytest.raises(InvalidRequest) as err:
        resolve_tool_context(body)
    assert err.value.code == "duplicate_tool_name"


# --- streamed back --------------------------------------------------------------------------------------------


def test_apply_patch_streams_its_diff_and_ends_as_an_sdk_valid_apply_patch_call() -> None:
    s = VllmStream().start().call("fc_abc", "call_1", "apply_patch", args_deltas(CREATE, 9)).complete()
    events = translate(s.body())
    summary = check_stream(events, REQUEST)
    types = _types(events)
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "apply_patch_call" and added["item"]["status"] == "in_progress"
    assert added["item"]["operation"] == {"type": "create_file", "path": "notes/hello.txt", "diff": ""}
    assert added["item"]["id"] == "apc_abc" and added["item"]["call_id"] == "call_1"
    deltas = [e["delta"] for e in events if e["type"] == "response.apply_patch_call_operation_diff.delta"]
    assert len(deltas) > 1, "the diff streams live, not in one piece at the end"
    [done] = [e for e in events if e["type"] == "response.apply_patch_call_operation_diff.done"]
    assert "".join(deltas) == done["diff"] == CREATE["operation"]["diff"]
    assert types.index("response.apply_patch_call_operation_diff.done") < types.index("response.output_item.done")
    assert "response.function_call_arguments.delta" not in types
    final = ResponseApplyPatchToolCall.model_validate(
        next(e for e in events if e["type"] == "response.output_item.done")["item"], strict=True)
    assert final.operation.type == "create_file" and final.status == "completed"
    assert final.operation.diff == CREATE["operation"]["diff"]  # type: ignore[union-attr]
    assert events[-1]["type"] == "response.completed" and summary
    sdk_response(events[-1]["response"])


def test_delete_file_has_no_diff_events() -> None:
    args = {"operation": {"type": "delete_file", "path": "old.txt"}}
    events = translate(VllmStream().start().call("fc_d", "call_d", "apply_patch", args_deltas(args, 3))
                       .complete().body())
    assert not any("operation_diff" in t for t in _types(events))
    final = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    assert final["operation"] == {"type": "delete_file", "path": "old.txt"}
    ResponseApplyPatchToolCall.model_validate(final, strict=True)


def test_shell_and_local_shell_calls_come_back_as_their_items() -> None:
    shell = {"action": {"commands": ["ls -la", "cat notes/hello.txt"], "timeout_ms": 5000}}
    local = {"action": {"command": ["echo", "hi"], "env": {"A": "1"}, "working_directory": "/tmp"}}
    s = (VllmStream().start().call("fc_s", "call_s", "shell", args_deltas(shell, 5))
         .call("fc_l", "call_l", "local_shell", args_deltas(local, 5)).complete())
    events = translate(s.body())
    check_stream(events, REQUEST)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(a["type"], a["id"], a["status"]) for a in added] == [("shell_call", "sh_s", "in_progress"),
                                                                 ("local_shell_call", "lsh_l", "in_progress")]
    ResponseFunctionShellToolCall.model_validate(added[0], strict=True)
    LocalShellCall.model_validate(added[1], strict=True)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    sh = ResponseFunctionShellToolCall.model_validate(done[0], strict=True)
    assert sh.action.commands == ["ls -la", "cat notes/hello.txt"] and sh.action.timeout_ms == 5000
    lsh = LocalShellCall.model_validate(done[1], strict=True)
    assert lsh.action.command == ["echo", "hi"] and lsh.action.env == {"A": "1"}
    assert lsh.action.working_directory == "/tmp" and lsh.call_id == "call_l"
    final = sdk_response(events[-1]["response"])
    assert [o.type for o in final.output] == ["shell_call", "local_shell_call"]
    assert not any(t.startswith("response.function_call_arguments") for t in _types(events))


def test_parallel_tool_calls_false_keeps_the_first_builtin_call_only() -> None:
    body = {**REQUEST, "parallel_tool_calls": False}
    s = (VllmStream().start().call("fc_1", "c1", "shell", args_deltas({"action": {"commands": ["ls"]}}, 3))
         .call("fc_2", "c2", "apply_patch", args_deltas(CREATE, 3)).complete())
    events = translate(s.body(), body)
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["shell_call"]
    assert not any("operation_diff" in t for t in _types(events))


def test_non_streamed_output_has_the_same_items() -> None:
    ctx = resolve_tool_context(REQUEST)
    state = build_request_state(REQUEST, ctx, response_id="r", created_at=1)
    items = [{"type": "function_call", "id": "fc_x", "call_id": "c", "name": "apply_patch",
              "arguments": json.dumps(CREATE), "status": "completed"}]
    [out] = restore_output(items, state)
    assert out == {"id": "apc_x", "type": "apply_patch_call", "call_id": "c", "status": "completed",
                   "operation": CREATE["operation"]}


def test_a_patch_cut_off_before_its_diff_is_still_closed() -> None:
    args = json.dumps(CREATE)
    s = VllmStream().start().call("fc_c", "cc", "apply_patch", [args[:20]], args_done=False, item_done=False)
    events = translate(s.body())  # the upstream stream ends early: response.failed, the call closed
    assert events[-1]["type"] == "response.failed"
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "apply_patch_call" and item["status"] == "in_progress"
    ResponseApplyPatchToolCall.model_validate(item, strict=True)


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    ['+a "quoted" \\ line\n', '"diff": "x"', '\\"type\\": \\"create_file\\"', "\\u0041"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(diff=texts, path=texts, ascii_only=st.booleans(),
       delta_cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
       byte_cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=20))
def test_rechunking_never_changes_the_streamed_diff(diff: str, path: str, ascii_only: bool, delta_cuts: list[int],
                                                   byte_cuts: list[int]) -> None:
    arguments = json.dumps({"operation": {"type": "update_file", "path": path, "diff": diff}},
                           ensure_ascii=ascii_only)
    pts = sorted({c % (len(arguments) + 1) for c in delta_cuts})
    pieces = [arguments[a:b] for a, b in zip([0, *pts], [*pts, len(arguments)], strict=True)]
    events = translate(VllmStream().start().call("fc_h", "ch", "apply_patch", pieces).complete().body(),
                       cuts=byte_cuts)
    check_stream(events, REQUEST)
    [added] = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added["operation"] == {"type": "update_file", "path": path, "diff": ""}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.apply_patch_call_operation_diff.delta")
    [done] = [e["diff"] for e in events if e["type"] == "response.apply_patch_call_operation_diff.done"]
    assert deltas == done == diff
    final = events[-1]["response"]["output"][0]
    assert final["operation"] == {"type": "update_file", "path": path, "diff": diff}


def test_patch_stream_gives_up_past_its_bound_and_the_call_still_completes() -> None:
    ps = PatchStream(limit=16)
    assert ps.feed('{"operation": {"type": "create_file", "pa') == "" and ps.gave_up
    assert ps.operation is None


# --- history back upstream ------------------------------------------------------------------------------------

HISTORY: list[dict[str, Any]] = [
    {"type": "apply_patch_call", "id": "apc_1", "call_id": "c1", "status": "completed",
     "operation": {"type": "create_file", "path": "a.txt", "diff": "+hi\n"}},
    {"type": "apply_patch_call_output", "call_id": "c1", "status": "failed", "output": "exists"},
    {"type": "shell_call", "id": "sh_1", "call_id": "c2", "status": "completed",
     "action": {"commands": ["ls"], "timeout_ms": None, "max_output_length": None}},
    {"type": "shell_call_output", "call_id": "c2", "max_output_length": None,
     "output": [{"stdout": "a.txt\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]},
    {"type": "local_shell_call", "id": "lsh_1", "call_id": "c3", "status": "completed",
     "action": {"type": "exec", "command": ["pwd"], "env": {}}},
    {"type": "local_shell_call_output", "id": "c3", "output": '{"stdout": "/w"}'},  # openai-python: by "id"
    {"type": "local_shell_call", "id": "lsh_2", "call_id": "c4", "status": "completed",
     "action": {"type": "exec", "command": ["true"], "env": {}}},
    {"type": "local_shell_call_output", "call_id": "c4", "output": "ok"},  # Agents SDK / AI SDK: by "call_id"
]


def test_history_items_go_upstream_as_function_calls_and_outputs() -> None:
    sdk = TypeAdapter(ResponseInputItem)
    for item in HISTORY[:-1]:  # openai-python's input models take the items as written (the last: the Agents SDK's)
        assert sdk.validate_python(item).type == item["type"]
    body = {**REQUEST, "input": HISTORY}
    up = build_upstream_request(body, resolve_tool_context(body))["input"]
    assert [(i["type"], i["call_id"]) for i in up] == [
        ("function_call", "c1"), ("function_call_output", "c1"), ("function_call", "c2"),
        ("function_call_output", "c2"), ("function_call", "c3"), ("function_call_output", "c3"),
        ("function_call", "c4"), ("function_call_output", "c4")]
    assert [i["name"] for i in up if i["type"] == "function_call"] == ["apply_patch", "shell", "local_shell",
                                                                       "local_shell"]
    assert json.loads(up[0]["arguments"]) == {"operation": HISTORY[0]["operation"]}
    assert json.loads(up[2]["arguments"]) == {"action": {"commands": ["ls"]}}
    assert json.loads(up[4]["arguments"]) == {"action": {"command": ["pwd"], "env": {}}}
    assert up[1]["output"] == "apply_patch failed: exists"
    assert json.loads(up[3]["output"]) == [{"stdout": "a.txt\n", "stderr": "",
                                            "outcome": {"type": "exit", "exit_code": 0}}]
    assert up[5]["output"] == '{"stdout": "/w"}' and up[7]["output"] == "ok"


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "apply_patch_call", "call_id": "c", "operation": {"type": "rename", "path": "x"}}, "input[0].operation"),
    ({"type": "shell_call", "call_id": "c", "action": "ls"}, "input[0].action"),
    ({"type": "shell_call_output", "call_id": "c", "output": "text"}, "input[0].output"),
    ({"type": "local_shell_call_output", "output": "x"}, "input[0].call_id"),
    ({"type": "apply_patch_call_output", "call_id": 5, "status": "completed"}, "input[0].call_id"),
])
def test_malformed_history_items_are_400s_naming_the_field(item: dict[str, Any], param: str) -> None:
    body = {**REQUEST, "input": [item]}
    with pytest.raises(InvalidRequest) as err:
        build_upstream_request(body, resolve_tool_context(body))
    assert err.value.param == param


# --- tool_choice enforcement ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("operation", "problem"), [
    ({"type": "create_file", "path": "a", "diff": "+x\n+y\n"}, None),
    ({"type": "create_file", "path": "a", "diff": "x\n"}, "line 1 of the create_file diff is not a V4A line"),
    ({"type": "update_file", "path": "a", "diff": "@@ def f():\n a\n-b\n+c\n\n*** End of File\n"}, None),
    ({"type": "update_file", "path": "a", "diff": "@@\n a\n b\n"}, "the update_file diff changes nothing"),
    ({"type": "update_file", "path": "a", "diff": " a\n*b\n"}, "line 2 of the update_file diff is not a V4A line"),
    ({"type": "delete_file", "path": "a"}, None),
])
def test_pinned_apply_patch_calls_are_checked_against_v4a(operation: dict[str, Any], problem: str | None) -> None:
    body = {**REQUEST, "tool_choice": {"type": "apply_patch"}}
    ctx = resolve_tool_context(body)
    item = {"type": "apply_patch_call", "id": "apc_1", "call_id": "c", "status": "completed", "operation": operation}
    verdict = check_pinned_output([item], ctx)
    assert verdict.ok is (problem is None) and (problem is None or problem in str(verdict.reason)), verdict


def test_pinned_shell_is_violated_by_another_call_or_by_text() -> None:
    ctx = resolve_tool_context({**REQUEST, "tool_choice": {"type": "shell"}})
    shell = {"type": "shell_call", "id": "sh_1", "call_id": "c", "status": "completed",
             "action": {"commands": ["ls"], "timeout_ms": None, "max_output_length": None}}
    local = {"type": "local_shell_call", "id": "lsh_1", "call_id": "c", "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "env": {}}}
    assert check_pinned_output([shell], ctx).ok
    assert "does not allow" in str(check_pinned_output([local], ctx).reason)
    assert not check_pinned_output([{"type": "message", "role": "assistant", "content": []}], ctx).ok


def test_a_pinned_apply_patch_with_a_broken_diff_fails_the_stream_under_validate() -> None:
    bad = {"operation": {"type": "create_file", "path": "a.txt", "diff": "no plus sign\n"}}

    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        resp.call("fc_1", "call_1", "apply_patch", args_deltas(bad, 4))

    upstream = Upstream(answer)
    body = {**REQUEST, "stream": True, "tool_choice": {"type": "apply_patch"}}
    with running_gateway(transport=upstream.transport, tool_choice_enforcement="validate") as url:
        with httpx.Client(timeout=30) as http:
            events = sse_events(http.post(url + "/v1/responses", json=body).content)
    assert upstream.requests[0]["tool_choice"] == {"type": "function", "name": "apply_patch"}
    types = _types(events)
    assert "response.apply_patch_call_operation_diff.delta" in types  # streamed live, then judged at the end
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "tool_choice_violation"
    assert "V4A" in events[-1]["response"]["error"]["message"]


# --- the chat path (--upstream-api chat) ------------------------------------------------------------------------


def test_chat_path_sends_the_history_as_tool_calls_and_streams_the_patch_back() -> None:
    import time

    from gateway.translate.chat import ChatToResponsesEvents, build_chat_request

    body = {**REQUEST, "input": HISTORY[:4]}
    up = build_chat_request(body, resolve_tool_context(body))
    assert [t["function"]["name"] for t in up["tools"]] == ["apply_patch", "shell", "local_shell"]
    calls = [c["function"]["name"] for m in up["messages"] for c in m.get("tool_calls") or ()]
    assert calls == ["apply_patch", "shell"]
    assert [m["tool_call_id"] for m in up["messages"] if m["role"] == "tool"] == ["c1", "c2"]

    # chat chunks in vLLM's shape (synthesized): one apply_patch tool call, its arguments cut in pieces
    arguments = json.dumps(CREATE)
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{
                  "id": "chatcmpl-tool-1", "type": "function", "index": 0,
                  "function": {"name": "apply_patch", "arguments": ""}}]}, "finish_reason": None}]}]
    for k in range(0, len(arguments), 11):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [{
            "index": 0, "function": {"arguments": arguments[k:k + 11]}}]}, "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
    state = build_request_state(REQUEST, resolve_tool_context(REQUEST), response_id="resp_c", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    conv = ChatToResponsesEvents(model="tiny", ids=new_id, clock=time.time)
    out: list[ClientEvent] = []
    for chunk in chunks:
        for ev in conv.feed(chunk):
            out += tr.feed(ev)
    for ev in conv.done():
        out += tr.feed(ev)
    out += tr.finish()
    events = sse_events(encode_events(out))
    check_stream(events, REQUEST)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.apply_patch_call_operation_diff.delta")
    assert deltas == CREATE["operation"]["diff"]
    [item] = events[-1]["response"]["output"]
    assert ResponseApplyPatchToolCall.model_validate(item, strict=True).operation.path == "notes/hello.txt"


def _commands_from_events(events: list[dict[str, Any]]) -> list[str]:
    """The commands as a client rebuilds them from the shell_call_command events (each checked by the SDK)."""
    from openai.types.responses import (
        ResponseShellCallCommandAddedEvent,
        ResponseShellCallCommandDeltaEvent,
        ResponseShellCallCommandDoneEvent,
    )

    models = {"response.shell_call_command.added": ResponseShellCallCommandAddedEvent,
              "response.shell_call_command.delta": ResponseShellCallCommandDeltaEvent,
              "response.shell_call_command.done": ResponseShellCallCommandDoneEvent}
    built: dict[int, str] = {}
    done: dict[int, str] = {}
    for e in events:
        if e["type"] in models:
            models[e["type"]].model_validate(e, strict=True)
        if e["type"] == "response.shell_call_command.added":
            assert e["command_index"] not in built
            built[e["command_index"]] = e["command"]
        elif e["type"] == "response.shell_call_command.delta":
            built[e["command_index"]] += e["delta"]
        elif e["type"] == "response.shell_call_command.done":
            assert e["command_index"] not in done
            done[e["command_index"]] = e["command"]
    assert built == done and sorted(done) == list(range(len(done)))
    return [done[i] for i in range(len(done))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commands=st.lists(texts, max_size=4), ascii_only=st.booleans(),
       delta_cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_shell_commands_stream_as_command_events_under_any_chunking(commands: list[str], ascii_only: bool,
                                                                    delta_cuts: list[int]) -> None:
    arguments = json.dumps({"action": {"commands": commands, "timeout_ms": 100}}, ensure_ascii=ascii_only)
    pts = sorted({c % (len(arguments) + 1) for c in delta_cuts})
    pieces = [arguments[a:b] for a, b in zip([0, *pts], [*pts, len(arguments)], strict=True)]
    events = translate(VllmStream().start().call("fc_s", "cs", "shell", pieces).complete().body())
    check_stream(events, REQUEST)
    assert _commands_from_events(events) == commands
    assert events[-1]["response"]["output"][0]["action"]["commands"] == commands


def test_shell_commands_stream_before_the_call_completes() -> None:
    args = {"action": {"commands": ["ls -la", "cat notes.txt"]}}
    events = translate(VllmStream().start().call("fc_s", "cs", "shell", args_deltas(args, 12)).complete().body())
    types = _types(events)
    first_done = types.index("response.shell_call_command.done")
    assert types.count("response.shell_call_command.delta") > 2  # live, in pieces
    assert first_done < types.index("response.output_item.done")
    assert _commands_from_events(events) == ["ls -la", "cat notes.txt"]


# --- abuse ----------------------------------------------------------------------------------------------------


def test_a_patch_padded_past_the_bound_is_not_buffered_and_still_completes() -> None:
    """Whitespace before the diff (strict decoding allows it) past --max-unnamed-call-bytes: the head is dropped,
    nothing is held beyond the bound, and the call is shown complete from the upstream's final arguments."""
    padded = '{"operation": {"type": "create_file",' + " " * 300_000 + '"path": "a", "diff": "+x\\n"}}'
    pieces = [padded[k:k + 4096] for k in range(0, len(padded), 4096)]
    state = build_request_state(REQUEST, resolve_tool_context(REQUEST), response_id="r", created_at=1)
    tr = FunctionSseTranslator(state, ids=new_id)
    s = VllmStream().start().call("fc_p", "cp", "apply_patch", pieces).complete()
    out: list[ClientEvent] = []
    parser = SseParser()
    for event, data in parser.feed(s.body()):
        out += tr.feed(UpstreamEvent(event, data))
    events = sse_events(encode_events(out))
    check_stream(events, REQUEST)
    [patch_state] = [i for i in tr._order if i.patch is not None]
    assert patch_state.patch is not None and patch_state.patch.gave_up and patch_state.patch._head == ""
    deltas = [e for e in events if e["type"] == "response.apply_patch_call_operation_diff.delta"]
    assert [d["delta"] for d in deltas] == ["+x\n"]  # one catch-up delta at the end
    assert events[-1]["response"]["output"][0]["operation"] == {"type": "create_file", "path": "a", "diff": "+x\n"}
    assert tr.stats.builtin_calls == 1


def test_builtin_calls_are_counted_under_their_own_metric_kind() -> None:
    from gateway.engine.record import RequestRecord
    from gateway.server.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    record = RequestRecord(request_id="r", route="/v1/responses", status=200)
    record.tool_calls = {"custom": 0, "function": 0, "builtin": 2}
    metrics.observe(record)
    assert 'responses_gateway_tool_calls_total{kind="builtin"} 2.0' in metrics.render().decode()


def test_a_call_whose_arguments_were_cut_off_is_never_completed() -> None:
    """vLLM stopped at the token limit inside the arguments: the client must not run half a command or patch."""
    shell_cut = '{"action": {"commands": ["rm -rf /tmp/x'
    patch_cut = '{"operation": {"type": "update_file", "path": "a", "diff": "@@\\n-a'
    s = (VllmStream().start().call("fc_s", "cs", "shell", [shell_cut])
         .call("fc_p", "cp", "apply_patch", [patch_cut]).complete("incomplete"))
    events = translate(s.body())
    check_stream(events, REQUEST)
    shell, patch = events[-1]["response"]["output"]
    assert shell["status"] == "incomplete" and patch["status"] == "in_progress"
    ctx = resolve_tool_context({**REQUEST, "tool_choice": {"type": "shell"}})
    assert "cut off" in str(check_pinned_output([shell], ctx).reason)
