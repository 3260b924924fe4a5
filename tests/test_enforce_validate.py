"""Validation (gateway/enforce/validate.py) and --tool-choice-enforcement validate against real vLLM answers."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.enforce.plan import Plan, plan_for
from gateway.enforce.validate import check_call, check_pinned_output, load_lark
from gateway.translate.tool_context import resolve_tool_context
from tests.invariants import check_stream
from tests.support import replay, running_gateway, sse_events

# vLLM accepts this form; Python's lark refuses /[^\n]*/ (zero-width): the gateway rewrites it to /[^\n]+/?.
VLLM_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
filename: /[a-zA-Z0-9_.\/-]+/
add_line: "+" /[^\n]*/ LF
%import common.LF
"""
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name."}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Get the current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": VLLM_PATCH_GRAMMAR}}
ZIP = {"type": "custom", "name": "zip_code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{5}"}}


def ctx_for(**body: Any) -> Any:
    return resolve_tool_context({"model": "tiny", "input": "x", **body})


def test_lark_grammar_with_zero_width_terminals_is_rewritten_and_checks_inputs() -> None:
    checker = load_lark(VLLM_PATCH_GRAMMAR)
    assert checker.parser is not None and checker.rewritten
    assert checker.check("*** Begin Patch\n*** Add File: a.txt\n+\n+hi\n*** End Patch\n") is None
    assert checker.check("*** Begin Patch\n*** End Patch") is not None  # hunk+ needs one hunk
    codex_like = 'start: "*** Begin Patch" LF line+ "*** End Patch"\nline: "+" /(.*)/ LF\n%import common.LF\n'
    assert load_lark(codex_like).check("*** Begin Patch\n+\n+x\n*** End Patch") is None


def test_a_grammar_lark_cannot_load_is_reported_unchecked_not_violated() -> None:
    ctx = ctx_for(tools=[{**PATCH, "format": {**PATCH["format"], "definition": "start: T\nT: /a*/\n"}}])
    _, verdict = check_call({"type": "custom_tool_call", "name": "apply_patch", "input": "zzz"}, ctx)
    assert verdict.ok and verdict.unchecked and "cannot load" in verdict.unchecked


def test_function_arguments_must_be_strict_json_objects_valid_against_the_schema() -> None:
    ctx = ctx_for(tools=[WEATHER])
    def check(args: str) -> bool:
        return check_call({"type": "function_call", "name": "get_weather", "arguments": args}, ctx)[1].ok
    assert check('{"city": "Paris"}')
    for bad in ("null", "Infinity", "[]", "{}", '{"city": 3}', '{"city": "x", "extra": 1}', '{"city": "x"'):
        assert not check(bad), bad


def test_regex_is_a_full_match() -> None:
    ctx = ctx_for(tools=[ZIP])
    assert check_call({"type": "custom_tool_call", "name": "zip_code", "input": "75001"}, ctx)[1].ok
    assert not check_call({"type": "custom_tool_call", "name": "zip_code", "input": "750012"}, ctx)[1].ok


def test_pinned_output_rules() -> None:
    ctx = ctx_for(tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_weather"})
    good = {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert check_pinned_output([good], ctx).ok
    assert "without one" in str(check_pinned_output([{"type": "message", "content": []}], ctx).reason)
    other = {"type": "function_call", "name": "get_time", "arguments": '{"timezone": "UTC"}'}
    assert "does not allow" in str(check_pinned_output([good, other], ctx).reason)
    cut = check_pinned_output([], ctx, status="incomplete")
    assert "token limit" in str(cut.reason)


def test_plan_per_tool_choice() -> None:
    assert not plan_for(ctx_for(tools=[WEATHER]), "constrain").active  # auto, no grammar tool
    assert plan_for(ctx_for(tools=[WEATHER], tool_choice="required"), "constrain").constrain
    assert not plan_for(ctx_for(tools=[WEATHER], tool_choice="required"), "off").active
    auto_grammar = plan_for(ctx_for(tools=[WEATHER, PATCH]), "constrain")
    assert auto_grammar.regenerate and not auto_grammar.pinned
    assert not plan_for(ctx_for(tools=[PATCH], tool_choice="none"), "constrain").active
    allowed = {"type": "allowed_tools", "mode": "required",
               "tools": [{"type": "function", "name": "get_time"}, {"type": "custom", "name": "zip_code"}]}
    validate = plan_for(ctx_for(tools=[WEATHER, TIME, ZIP], tool_choice=allowed), "validate")
    assert isinstance(validate, Plan) and [i.name for i in validate.pinned] == ["get_time", "zip_code"]
    assert validate.check_pinned and not validate.constrain


# ---------------------------------------------------------------------------------------------- through the gateway


FUNCTION_CALL_REQUEST = {"model": "tiny", "input": "What is the weather in Paris?", "tools": [WEATHER],
                         "tool_choice": "required", "max_output_tokens": 64}


@pytest.mark.parametrize("api,name", [("responses", "function_call"), ("chat", "chat_tool_call")])
def test_validate_catches_the_unenforced_answer_non_streamed(api: str, name: str) -> None:
    # What the real tiny vLLM answered to tool_choice "required": a call whose arguments are "null".
    request = {**FUNCTION_CALL_REQUEST, "tools": [WEATHER, TIME]} if api == "chat" else FUNCTION_CALL_REQUEST
    with running_gateway(transport=replay(f"{name}_nonstream"), upstream_api=api,
                         tool_choice_enforcement="validate") as url:
        r = httpx.post(url + "/v1/responses", json=request, timeout=30)
    assert r.status_code == 200
    final = r.json()
    assert final["status"] == "failed"
    assert final["error"]["code"] == "tool_choice_violation"
    assert "not a JSON object" in final["error"]["message"]
    assert final["output"][0]["arguments"] == "null"  # what came back stays visible


@pytest.mark.parametrize("api,name", [("responses", "function_call"), ("chat", "chat_tool_call")])
def test_validate_catches_the_unenforced_answer_streamed(api: str, name: str) -> None:
    request = {**FUNCTION_CALL_REQUEST, "stream": True}
    if api == "chat":
        request["tools"] = [WEATHER, TIME]
    with running_gateway(transport=replay(f"{name}_stream"), upstream_api=api,
                         tool_choice_enforcement="validate") as url:
        r = httpx.post(url + "/v1/responses", json=request, timeout=30)
        events = sse_events(r.content)
        summary = check_stream(events, request)
        assert summary["terminal"] == "response.failed"
        assert summary["response"]["error"]["code"] == "tool_choice_violation"
    # the strict SDK sees the failure as a failed response, not a malformed stream
    with running_gateway(transport=replay(f"{name}_stream"), upstream_api=api,
                         tool_choice_enforcement="validate") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        body = {k: v for k, v in request.items() if k != "stream"}
        with client.responses.stream(**body) as stream:
            types = [e.type for e in stream]
    assert types[-1] == "response.failed"


def test_off_passes_the_same_answer_through_unchanged() -> None:
    with running_gateway(transport=replay("function_call_nonstream"), tool_choice_enforcement="off") as url:
        final = httpx.post(url + "/v1/responses", json=FUNCTION_CALL_REQUEST, timeout=30).json()
    assert final["status"] == "completed" and final["error"] is None


def test_validate_accepts_a_valid_call() -> None:
    # the strict shim of a text custom tool: any string input is valid
    request = {"model": "tiny", "input": "Create an empty patch.", "tools": [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}],
        "tool_choice": {"type": "custom", "name": "apply_patch"}}
    with running_gateway(transport=replay("custom_tool_call_strict_nonstream"),
                         tool_choice_enforcement="validate") as url:
        final = httpx.post(url + "/v1/responses", json=request, timeout=30).json()
    assert final["status"] == "completed" and final["output"][0]["type"] == "custom_tool_call"
