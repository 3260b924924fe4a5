"""ResolvedToolContext: one resolution per request, each validation rule, and what reads it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from gateway.errors import InvalidRequest
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.tool_context import UPSTREAM_NAME_LIMIT, flat_name, resolve_tool_context
from tests.invariants import check_stream
from tests.support import replay, running_gateway, sse_events

FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CUSTOM = {"type": "custom", "name": "apply_patch"}
NS = {"type": "namespace", "name": "crm", "description": "CRM tools.", "tools": [
    {"type": "function", "name": "get_customer_profile", "parameters": {"type": "object"}},
    {"type": "custom", "name": "crm_query"}]}


def bad(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as exc:
        resolve_tool_context(body)
    assert exc.value.type == "invalid_request_error" and exc.value.status == 400
    return exc.value


def test_initial_and_effective_tools_and_kinds() -> None:
    dev_tool = {"type": "custom", "name": "dyn"}
    ctx = resolve_tool_context({"tools": [FN, NS], "input": [
        {"role": "developer", "content": "", "tools": [dev_tool]}, {"role": "user", "content": "hi"}]})
    assert ctx.initial_tools == (FN, NS)
    assert ctx.effective_tools == (FN, NS, dev_tool)
    kinds = {k: (v.kind, v.name, v.namespace) for k, v in ctx.by_upstream_name.items()}
    assert kinds == {"get_weather": ("function", "get_weather", None),
                     "crm__get_customer_profile": ("function", "get_customer_profile", "crm"),
                     "crm__crm_query": ("custom", "crm_query", "crm"), "dyn": ("custom", "dyn", None)}
    with pytest.raises(AttributeError):
        ctx.tool_choice = "none"  # type: ignore[misc]  # immutable


def test_duplicate_names_request_level_and_dynamic() -> None:
    err = bad({"tools": [FN, {**FN}]})
    assert err.code == "duplicate_tool_name" and err.param == "tools[1].name" and "get_weather" in err.message
    err = bad({"tools": [CUSTOM], "input": [{"role": "developer", "content": "", "tools": [CUSTOM]}]})
    assert err.code == "duplicate_tool_name" and err.param == "input[0].tools[0].name"


def test_required_without_tools_and_auto_without_tools() -> None:
    err = bad({"tool_choice": "required", "input": "x"})
    assert err.param == "tool_choice" and "required" in err.message
    # "auto" with no tools is what OpenAI accepts, and what Codex's local compaction turn sends
    ctx = resolve_tool_context({"tool_choice": "auto", "input": "x"})
    assert ctx.tool_choice == "auto" and not ctx.effective_tools


@pytest.mark.parametrize("choice,param,text", [
    ({"type": "function", "name": "nope"}, "tool_choice.name", "nope"),
    ({"type": "custom", "name": "get_weather"}, "tool_choice.type", "get_weather"),
    ({"type": "function", "name": "apply_patch"}, "tool_choice.type", "apply_patch"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "ghost"}]},
     "tool_choice.tools[0]", "ghost"),
    ({"type": "allowed_tools", "mode": "sometimes", "tools": [{"type": "function", "name": "get_weather"}]},
     "tool_choice.mode", "sometimes"),
    ("whenever", "tool_choice", "whenever"),
])
def test_tool_choice_validation(choice: Any, param: str, text: str) -> None:
    err = bad({"tools": [FN, CUSTOM], "tool_choice": choice})
    assert err.param == param and text in err.message


def test_defaults() -> None:
    assert resolve_tool_context({"input": "x"}).tool_choice == "none"
    assert resolve_tool_context({"tools": [FN]}).tool_choice == "auto"
    dyn_only = resolve_tool_context({"input": [{"role": "developer", "content": "", "tools": [CUSTOM]}]})
    assert dyn_only.tool_choice == "auto" and dyn_only.initial_tools == ()
    assert resolve_tool_context({"tools": [FN]}).parallel_tool_calls is True
    assert resolve_tool_context({"tools": [FN], "parallel_tool_calls": False}).parallel_tool_calls is False


def test_namespace_flattening_is_deterministic_and_fits_vllm() -> None:
    long_ns, long_member = "n" * 60, "m" * 100
    a, b = flat_name(long_ns, long_member), flat_name(long_ns, long_member)
    assert a == b and len(a) <= UPSTREAM_NAME_LIMIT
    assert flat_name(long_ns, long_member + "x") != a
    assert flat_name("crm", "get") == "crm__get"


def test_namespace_flat_name_collision_is_rejected() -> None:
    err = bad({"tools": [NS, {"type": "function", "name": "crm__crm_query"}]})
    assert err.code == "duplicate_tool_name" and "crm__crm_query" in err.message


def test_dynamic_developer_tools_are_sent_upstream_as_tools_not_in_the_message() -> None:
    body = {"input": [{"role": "developer", "content": "", "tools": [CUSTOM]}, {"role": "user", "content": "go"}]}
    up = build_upstream_request(body, resolve_tool_context(body))
    assert up["tools"][0]["name"] == "apply_patch" and up["tool_choice"] == "auto"
    assert up["input"][0] == {"role": "developer", "content": ""}


# --- end to end --------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


@pytest.mark.parametrize("cassette,calls", [("interleaved_two_calls", 2), ("interleaved_three_calls", 3)])
def test_parallel_tool_calls_false_streamed_keeps_only_the_first_call(cassette: str, calls: int) -> None:
    tools = [WEATHER, PATCH, TIME]
    with running_gateway(tool_choice_enforcement="off", transport=replay(f"{cassette}_stream")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with c.responses.stream(model="tiny", input="x", tools=tools, parallel_tool_calls=False) as stream:
            events = [e.model_dump(warnings=False) for e in stream]
            final = stream.get_final_response()
        raw = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "tools": tools, "stream": True,
                                                      "parallel_tool_calls": False}).content
    assert [i.type for i in final.output] == ["message", "function_call", "message"]
    assert final.parallel_tool_calls is False
    summary = check_stream(sse_events(raw), {"tools": tools, "parallel_tool_calls": False})
    assert [i["type"] for i in summary["items"]] == ["message", "function_call", "message"]
    assert not [e for e in events if "custom_tool_call" in e["type"]]  # the later calls produce no events at all


@pytest.mark.parametrize("cassette", ["interleaved_two_calls_nonstream", "interleaved_three_calls_nonstream"])
def test_parallel_tool_calls_false_non_streamed(cassette: str) -> None:
    with running_gateway(tool_choice_enforcement="off", transport=replay(cassette)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = c.responses.create(model="tiny", input="x", tools=[WEATHER, PATCH, TIME], parallel_tool_calls=False)
        both = c.responses.create(model="tiny", input="x", tools=[WEATHER, PATCH, TIME])
    assert [i.type for i in resp.output] == ["message", "function_call", "message"]
    assert [i.type for i in both.output].count("message") == 2 and len(both.output) >= 4


def test_developer_message_declares_the_only_tool_and_a_custom_call_round_trips() -> None:
    transport = replay("custom_tool_call_strict_stream", "continuation_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        dev = {"role": "developer", "content": "", "tools": [PATCH]}
        with c.responses.stream(model="tiny", input=[dev, {"role": "user", "content": "patch"}]) as stream:
            for _ in stream:
                pass
            first = stream.get_final_response()
        [call] = first.output
        assert call.type == "custom_tool_call" and call.name == "apply_patch"
        assert first.tools == [] and first.tool_choice == "auto"
        c.responses.create(model="tiny", input=[
            dev, {"role": "user", "content": "patch"},
            {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}])
    sent_first, sent_second = transport.requests[0]["body"], transport.requests[1]["body"]
    assert sent_first["tool_choice"] == "auto" and sent_first["tools"][0]["name"] == "apply_patch"
    assert "tools" not in sent_first["input"][0]
    fc, out = sent_second["input"][2], sent_second["input"][3]
    assert fc["type"] == "function_call" and json.loads(fc["arguments"]) == {"input": call.input}
    assert out == {"type": "function_call_output", "call_id": call.call_id, "output": "Done."}


def test_namespace_round_trip_including_history() -> None:
    transport = replay("namespace_calls_stream", "namespace_calls_nonstream", "continuation_nonstream")
    with running_gateway(tool_choice_enforcement="off", transport=transport) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with c.responses.stream(model="tiny", input="who?", tools=[NS]) as stream:
            events = [e.model_dump(warnings=False) for e in stream]
            final = stream.get_final_response()
        body = c.responses.create(model="tiny", input="who?", tools=[NS])
        fn, custom = final.output
        c.responses.create(model="tiny", tools=[NS], input=[
            {"type": "function_call", "call_id": fn.call_id, "name": fn.name, "namespace": "crm",
             "arguments": fn.arguments},
            {"type": "function_call_output", "call_id": fn.call_id, "output": "{}"},
            {"type": "custom_tool_call", "call_id": custom.call_id, "name": "crm_query", "namespace": "crm",
             "input": custom.input},
            {"type": "custom_tool_call_output", "call_id": custom.call_id, "output": "1"}])
    assert (fn.type, fn.name, fn.namespace) == ("function_call", "get_customer_profile", "crm")
    assert (custom.type, custom.name, custom.namespace, custom.input) == ("custom_tool_call", "crm_query", "crm",
                                                                         "SELECT 1")
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["name"] == "get_customer_profile" and added[0]["namespace"] == "crm"
    args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert args_done["name"] == "get_customer_profile"
    assert [(i.name, i.namespace) for i in body.output] == [("get_customer_profile", "crm"), ("crm_query", "crm")]
    upstream_tools = [t["name"] for t in transport.requests[0]["body"]["tools"]]
    assert upstream_tools == ["crm__get_customer_profile", "crm__crm_query"]
    history = transport.requests[2]["body"]["input"]
    assert [i.get("name") for i in history if i["type"] == "function_call"] == ["crm__get_customer_profile",
                                                                                 "crm__crm_query"]
    assert all("namespace" not in i for i in history)


def test_a_builtin_apply_patch_choice_names_the_declared_custom_tool() -> None:
    """The Vercel AI SDK forces a custom tool named apply_patch with {"type": "apply_patch"}."""
    body = {"tools": [{"type": "custom", "name": "apply_patch"}, {"type": "function", "name": "f"}],
            "tool_choice": {"type": "apply_patch"}}
    ctx = resolve_tool_context(body)
    assert ctx.tool_choice == {"type": "apply_patch"}  # echoed as the client sent it
    assert ctx.upstream_tool_choice == {"type": "function", "name": "apply_patch"}
    assert [i.name for i in ctx.pinned_tools] == ["apply_patch"]
    # without such a tool it stays a hosted choice, passed on
    hosted = resolve_tool_context({"tools": [{"type": "function", "name": "f"}],
                                   "tool_choice": {"type": "apply_patch"}})
    assert hosted.upstream_tool_choice == {"type": "apply_patch"}
