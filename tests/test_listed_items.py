"""Listings in the SDK's exact shapes: every item ``input_items`` and the conversation item endpoints return, of
every type the gateway stores, validates strictly against the newest openai SDK's item models (``ResponseItem``,
``ConversationItem``) — whatever shape the client sent it in (a string ``content``, an output without ``status``…).

The upstream replays recorded vLLM answers (cassettes/vllm/); the store is SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.protocol.items import listed_item
from gateway.store import ResponseStore
from tests.conversation_support import BACKENDS, fresh_store, sdk
from tests.sdk_shapes import validate_conversation_item, validate_response_item
from tests.support import replay, running_gateway

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

# Every item type a client sends as input, each in the loosest shape OpenAI's API accepts.
MIXED_INPUT: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},  # no type
    {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "System."}]},
    {"type": "message", "role": "user", "content": "Weather in Paris?"},
    {"type": "message", "role": "assistant", "content": "Let me check."},  # an assistant turn as a string
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "No annotations."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "Sent as input_text."}]},
    {"type": "function_call", "call_id": "call_w1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
    {"type": "function_call_output", "call_id": "call_w1", "output": "Sunny."},  # no status
    {"type": "function_call_output", "call_id": "call_w1",
     "output": [{"type": "input_text", "text": "Sunny, in parts."}]},
    {"type": "custom_tool_call", "call_id": "call_p1", "name": "apply_patch",
     "input": "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"},
    {"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done."},
    {"type": "reasoning", "id": "rs_0000000000000001", "summary": [],
     "content": [{"type": "reasoning_text", "text": "Thinking."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    with fresh_store(request.param, tmp_path) as st:
        yield st


def test_every_listed_item_validates_with_the_sdk_models(store: ResponseStore) -> None:
    transport = replay("text_completed_nonstream")
    with running_gateway(transport=transport, store=store) as url:
        client = sdk(url)
        conv = client.conversations.create(items=[{"role": "user", "content": "Hello."}])
        created = httpx.post(url + "/v1/responses", json={
            "model": "tiny", "input": MIXED_INPUT, "tools": [WEATHER, PATCH], "conversation": conv.id}, timeout=30)
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        listed = httpx.get(f"{url}/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 100}).json()
        items = httpx.get(f"{url}/v1/conversations/{conv.id}/items", params={"order": "asc", "limit": 100}).json()
        added = httpx.post(f"{url}/v1/conversations/{conv.id}/items", json={"items": [
            {"type": "function_call_output", "call_id": "call_w1", "output": "Rain."},
            {"role": "assistant", "content": "Added."}]}).json()
        one = httpx.get(f"{url}/v1/conversations/{conv.id}/items/{items['data'][0]['id']}").json()
        # and through the SDK's own list calls (its parsing is loose: the strict checks are below)
        sdk_listed = list(client.responses.input_items.list(rid, order="asc"))
        sdk_items = list(client.conversations.items.list(conv.id, order="asc"))

    assert [i["type"] for i in listed["data"]] == [i.get("type", "message") for i in MIXED_INPUT]
    for item in listed["data"]:
        validate_response_item(item)
    types = [i["type"] for i in items["data"]]
    assert types == ["message", *(i.get("type", "message") for i in MIXED_INPUT), "message"], types
    for item in [*items["data"], *added["data"], one]:
        validate_conversation_item(item)
    assert [i.type for i in sdk_listed] == [i["type"] for i in listed["data"]]
    assert len(sdk_items) == len(items["data"]) + 2
    # what the client sent is what is listed, in the SDK's shape
    by_call = [i for i in listed["data"] if i["type"] == "function_call_output"]
    assert by_call[0]["output"] == "Sunny." and by_call[0]["status"] == "completed"
    assistant = listed["data"][3]
    assert assistant["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]
    assert listed["data"][0]["content"] == [{"type": "input_text", "text": "Be brief."}]


def test_items_stored_in_the_old_shape_are_listed_in_the_new_one() -> None:
    """The shapes are made on read: a stored item is not rewritten, and one stored before is listed right."""
    stored = {"type": "function_call_output", "id": "item_1", "call_id": "c", "output": "x"}
    assert listed_item(stored) == {**stored, "status": "completed"} and "status" not in stored
    validate_response_item(listed_item(stored))
    validate_conversation_item(listed_item(stored))
    message = {"type": "message", "id": "msg_1", "role": "user", "content": "hi"}
    validate_response_item(listed_item(message))
    validate_conversation_item(listed_item(message))
    assert listed_item({"type": "reasoning", "id": "rs_1"})["summary"] == []
    image = listed_item({"type": "message", "id": "msg_2", "role": "user",
                         "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]})
    assert image["content"][0]["detail"] == "auto"
    validate_conversation_item(image)
    with pytest.raises(AssertionError):  # the judge can fail: an item without its required fields
        validate_response_item({"type": "function_call", "id": "fc_1"})


def test_the_suite_wide_check_catches_a_completed_event_the_sdk_rejects(
        sdk_validates_every_completed_event: list[tuple[Exception, bytes]]) -> None:
    """tests/conftest.py validates every response.completed the gateway builds; here one without usage details."""
    from gateway.protocol.events import ClientEvent

    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": "tiny", "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "completed",
                "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
                "temperature": None, "top_p": None,
                "usage": {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}}
    ClientEvent.of({"type": "response.completed", "sequence_number": 2, "response": response})
    assert len(sdk_validates_every_completed_event) == 1
    assert "cache_write_tokens" in str(sdk_validates_every_completed_event[0][0])
    sdk_validates_every_completed_event.clear()
    from gateway.server.http import OrjsonResponse

    OrjsonResponse(response)  # a non-streamed body: checked too
    assert len(sdk_validates_every_completed_event) == 1
    sdk_validates_every_completed_event.clear()
    response["usage"]["input_tokens_details"]["cache_write_tokens"] = 0  # type: ignore[index]
    ClientEvent.of({"type": "response.completed", "sequence_number": 2, "response": response})
    OrjsonResponse(response)
    assert sdk_validates_every_completed_event == []
