"""Request rewriting: what vLLM receives for what the client sent."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.translate.rewrite import INPUT_PARAM_SCHEMA, build_upstream_request
from gateway.translate.tool_context import resolve_tool_context

LARK = 'start: "*** Begin Patch" LF hunk+ "*** End Patch"\n%import common.LF'


def rewrite(body: dict) -> dict:
    return build_upstream_request(body, resolve_tool_context(body))


def test_custom_tool_becomes_a_strict_function_with_one_string_input_and_the_grammar_in_its_description() -> None:
    up = rewrite({"model": "m", "input": "x", "tools": [{"type": "custom", "name": "apply_patch",
                  "description": "Apply a patch.", "format": {"type": "grammar", "syntax": "lark",
                                                              "definition": LARK}}]})
    [tool] = up["tools"]
    assert tool["type"] == "function" and tool["name"] == "apply_patch"
    assert tool["parameters"] == INPUT_PARAM_SCHEMA
    assert tool["parameters"]["required"] == ["input"] and tool["parameters"]["additionalProperties"] is False
    assert tool["description"].startswith("Apply a patch.")
    assert LARK in tool["description"] and "lark" in tool["description"]
    assert up["store"] is False and up["model"] == "m"


def test_named_custom_choice_becomes_a_named_function_choice() -> None:
    up = rewrite({"input": "x", "tools": [{"type": "custom", "name": "run"}],
                  "tool_choice": {"type": "custom", "name": "run"}})
    assert up["tool_choice"] == {"type": "function", "name": "run"}


def test_allowed_tools_becomes_the_filtered_list_and_its_mode() -> None:
    body = {"input": "x", "tools": [{"type": "function", "name": "a"}, {"type": "custom", "name": "b"},
                                    {"type": "function", "name": "c"}],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": "a"}, {"type": "custom", "name": "b"}]}}
    up = rewrite(body)
    assert [t["name"] for t in up["tools"]] == ["a", "b"]
    assert up["tool_choice"] == "required"


def test_history_custom_items_become_function_items_with_the_same_call_id() -> None:
    body = {"input": [
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "apply_patch",
         "input": "*** Begin Patch\n\"q\"\n"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "ok"},
    ], "tools": [{"type": "custom", "name": "apply_patch"}]}
    items = rewrite(body)["input"]
    assert items[0] == {"role": "user", "content": "patch it"}
    assert items[1]["type"] == "function_call" and items[1]["call_id"] == "call_1"
    assert json.loads(items[1]["arguments"]) == {"input": "*** Begin Patch\n\"q\"\n"}
    assert items[2] == {"type": "function_call_output", "call_id": "call_1", "output": "ok"}


def test_tool_output_arrays_keep_their_parts() -> None:
    body = {"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "21C"}, {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]}
    [item] = rewrite(body)["input"]
    assert item["output"][0] == {"type": "input_text", "text": "21C"}
    assert item["output"][1]["detail"] == "auto"  # vLLM requires it


def test_file_parts_in_tool_outputs_are_refused_naming_the_part() -> None:
    body = {"input": [{"type": "custom_tool_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "a"}, {"type": "input_file", "file_data": "data:text/plain;base64,YQ=="}]}]}
    with pytest.raises(InvalidRequest) as exc:
        rewrite(body)
    assert exc.value.param == "input[0].output[1]" and "input_file" in exc.value.message


def test_unknown_fields_items_and_tool_types_pass_through() -> None:
    body = {"model": "my-alias", "input": [{"type": "mystery_item", "x": 1}], "frobnicate": {"a": 1},
            "tools": [{"type": "web_search_preview"}], "include": ["message.output_text.logprobs", "x.y"]}
    up = rewrite(body)
    assert up["model"] == "my-alias" and up["frobnicate"] == {"a": 1}
    assert up["input"] == [{"type": "mystery_item", "x": 1}]
    assert up["tools"] == [{"type": "web_search_preview"}]
    assert up["include"] == ["message.output_text.logprobs"]  # vLLM rejects any other include value


def test_state_fields_stay_in_the_gateway() -> None:
    up = rewrite({"input": "x", "store": True, "previous_response_id": "resp_1", "background": False})
    assert up["store"] is False and "previous_response_id" not in up and "background" not in up


def test_tool_choice_none_keeps_tools_away_from_the_model() -> None:
    up = rewrite({"input": "x", "tools": [{"type": "function", "name": "a"}], "tool_choice": "none"})
    assert "tools" not in up and up["tool_choice"] == "none"
