"""Each built-in tool call item and its output through the store: the second turn by ``previous_response_id``, by
full history with ``store: false``, by ``conversation`` and by ``item_reference``. vLLM must get the call and its
output as a function call and its output every time; what the gateway lists back (``input_items``, conversation
items) keeps the items' own shapes, which the newest openai SDK's models validate.

The upstream is SYNTHESIZED in vLLM 0.32's framing (tests/test_js_clients.Upstream on tests/vllm_frames.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.conversations import ConversationItem
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from gateway.store import SqliteResponseStore
from tests.support import running_gateway
from tests.test_js_clients import ScriptedVllm, Upstream, _hex
from tests.vllm_frames import args_deltas

TOOLS = [{"type": "apply_patch"}, {"type": "shell", "environment": {"type": "local"}}, {"type": "local_shell"}]
ARGS = {
    "apply_patch": {"operation": {"type": "create_file", "path": "a.txt", "diff": "+hi\n"}},
    "shell": {"action": {"commands": ["ls"]}},
    "local_shell": {"action": {"command": ["ls", "-a"], "env": {}}},
}
CALL_TYPE = {"apply_patch": "apply_patch_call", "shell": "shell_call", "local_shell": "local_shell_call"}


def output_item(tool: str, call_id: str, *, by_id: bool = False) -> dict[str, Any]:
    if tool == "apply_patch":
        return {"type": "apply_patch_call_output", "call_id": call_id, "status": "completed", "output": "created a.txt"}
    if tool == "shell":
        return {"type": "shell_call_output", "call_id": call_id,
                "output": [{"stdout": "a.txt\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]}
    # local_shell_call_output: openai-python names the call by "id", the Agents SDK and the AI SDK by "call_id"
    return {"type": "local_shell_call_output", ("id" if by_id else "call_id"): call_id, "output": '{"stdout":"a.txt"}'}


def answer_for(tool: str):  # type: ignore[no-untyped-def]
    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        if any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items):
            resp.message(f"msg_{_hex()}", ["Done."])
        else:
            resp.call(f"fc_{_hex()}", f"call_{_hex()}", tool, args_deltas(ARGS[tool], 4))
    return answer


def upstream_pair(upstream: Upstream, tool: str) -> None:
    """The second upstream request holds the call and its output as a function call and its output."""
    items = upstream.requests[-1]["input"]
    calls = [i for i in items if i.get("type") == "function_call"]
    outs = [i for i in items if i.get("type") == "function_call_output"]
    assert [c["name"] for c in calls] == [tool], items
    assert json.loads(calls[0]["arguments"]) == ARGS[tool] if tool != "shell" else True
    assert [o["call_id"] for o in outs] == [calls[0]["call_id"]], items
    assert not any(i.get("type", "").startswith(("apply_patch", "shell", "local_shell")) for i in items)


OURS = ("apply_patch_call", "apply_patch_call_output", "shell_call", "shell_call_output", "local_shell_call",
        "local_shell_call_output")


def validate_listing(items: list[dict[str, Any]], model: Any) -> list[str]:
    """The built-in items of a listing through the SDK's model (messages' listing shapes are issue 19's part 3,
    another change); their types."""
    adapter = TypeAdapter(model)
    return [adapter.validate_python(i).type for i in items if i.get("type") in OURS]


@pytest.mark.parametrize("tool", ["apply_patch", "shell", "local_shell"])
@pytest.mark.parametrize("mode", ["previous_response_id", "store_false", "conversation", "item_reference"])
def test_second_turn_carries_the_call_and_its_output(tool: str, mode: str, tmp_path: Path) -> None:
    upstream = Upstream(answer_for(tool))
    with running_gateway(transport=upstream.transport, store=SqliteResponseStore(tmp_path / "r.db")) as url, \
            httpx.Client(base_url=url + "/v1", timeout=30) as http:
        first_body: dict[str, Any] = {"model": "tiny", "tools": TOOLS, "input": "go"}
        conv_id = None
        if mode == "store_false":
            first_body["store"] = False
        if mode == "conversation":
            conv_id = http.post("/conversations", json={}).json()["id"]
            first_body["conversation"] = conv_id
        first = http.post("/responses", json=first_body).json()
        [call] = first["output"]
        assert call["type"] == CALL_TYPE[tool], call
        TypeAdapter(ResponseItem).validate_python(call)
        out = output_item(tool, call["call_id"], by_id=mode == "store_false")
        second_body: dict[str, Any] = {"model": "tiny", "tools": TOOLS}
        if mode == "previous_response_id":
            second_body.update(previous_response_id=first["id"], input=[out])
        elif mode == "store_false":
            second_body.update(store=False, input=[{"role": "user", "content": "go"}, call, out])
        elif mode == "conversation":
            second_body.update(conversation=conv_id, input=[out])
        else:
            second_body.update(input=[{"role": "user", "content": "go"}, {"type": "item_reference", "id": call["id"]},
                                      out])
        resp = http.post("/responses", json=second_body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["output"][0]["type"] == "message"
        upstream_pair(upstream, tool)
        if mode == "store_false":
            return
        listed = http.get(f"/responses/{resp.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert out["type"] in validate_listing(listed, ResponseItem)
        if mode == "conversation":
            conv_items = http.get(f"/conversations/{conv_id}/items", params={"order": "asc"}).json()["data"]
            types = validate_listing(conv_items, ConversationItem)
            assert CALL_TYPE[tool] in types and out["type"] in types, types
            stored_call = next(i for i in conv_items if i["type"] == CALL_TYPE[tool])
            assert stored_call["id"] == call["id"] and stored_call.get("operation", stored_call.get("action")) == \
                call.get("operation", call.get("action"))


@pytest.mark.parametrize("tool", ["apply_patch", "shell"])
def test_another_key_cannot_reach_a_built_in_call(tool: str, tmp_path: Path) -> None:
    """A stored apply_patch/shell call belongs to the key that made it: another key can neither chain onto its
    response nor reference the call's item id (what would put one tenant's patch or command in another's
    prompt)."""
    upstream = Upstream(answer_for(tool))
    keys = ("sk-tenant-a-0123456789", "sk-tenant-b-9876543210")
    with running_gateway(transport=upstream.transport, store=SqliteResponseStore(tmp_path / "r.db"),
                         api_keys=keys) as url:
        a, b = ({"authorization": f"Bearer {k}"} for k in keys)
        first = httpx.post(url + "/v1/responses", json={"model": "tiny", "tools": TOOLS, "input": "go"}, headers=a,
                           timeout=30).json()
        [call] = first["output"]
        sent = len(upstream.requests)
        chained = httpx.post(url + "/v1/responses", headers=b, timeout=30, json={
            "model": "tiny", "tools": TOOLS, "previous_response_id": first["id"],
            "input": [output_item(tool, call["call_id"])]})
        referenced = httpx.post(url + "/v1/responses", headers=b, timeout=30, json={
            "model": "tiny", "tools": TOOLS, "input": [{"type": "item_reference", "id": call["id"]}]})
        listed = httpx.get(url + f"/v1/responses/{first['id']}/input_items", headers=b, timeout=30)
    assert chained.status_code == 404, chained.text
    assert referenced.status_code in (400, 404), referenced.text
    assert listed.status_code == 404
    assert len(upstream.requests) == sent  # nothing of A's reached the upstream for B
