"""A conversation carrying gateway-executed MCP items and custom tool calls, continued in background mode.

The upstream is SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py); the MCP side is the loop's in-process
executor from tests/test_mcp_loop.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.store import SqliteResponseStore
from gateway.translate.mcp_items import mcp_name
from tests.support import running_gateway
from tests.test_mcp_loop import CALC, FakeHub
from tests.vllm_frames import VllmStream, args_deltas

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


class Upstream:
    """Turn 1: an MCP call, then text; turn 2: a custom call; turn 3: text. Streams only (the loop and
    background runs always stream upstream)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        n = len(self.bodies)
        if n == 1:
            s = VllmStream().start()
            s.call("fc_00000000000000b1", "call_b1", mcp_name("calc", "add"), [json.dumps({"a": 40, "b": 2})])
            stream = s.complete()
        elif n == 3:
            s = VllmStream().start()
            s.call("fc_00000000000000b3", "call_b3", "apply_patch",
                   args_deltas({"input": "*** Begin Patch\n*** End Patch\n"}))
            stream = s.complete()
        else:  # a message id of its own per turn, as vLLM's are (a conversation keeps one item per id)
            stream = VllmStream().start().message(f"msg_{n:016x}", [f"answer {n}"]).complete()
        if not body.get("stream"):
            return httpx.Response(200, json=json.loads(stream.nonstream_body()))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.body())


def test_conversation_with_mcp_items_and_a_background_custom_call(tmp_path: Path) -> None:
    hub, up = FakeHub(), Upstream()
    with running_gateway(transport=httpx.MockTransport(up), mcp=hub,
                         store=SqliteResponseStore(tmp_path / "r.db")) as url:
        conv = httpx.post(url + "/v1/conversations", json={"items": [
            {"type": "message", "role": "user", "content": "Let us compute."}]}).json()
        r1 = httpx.post(url + "/v1/responses", json={"model": "tiny", "conversation": conv["id"], "tools": [CALC],
                                                     "input": "What is 40 + 2?"}, timeout=30).json()
        assert [i["type"] for i in r1["output"]] == ["mcp_list_tools", "mcp_call", "message"], r1
        # turn 2 in background: a custom tool call; polled until it completes
        queued = httpx.post(url + "/v1/responses", json={"model": "tiny", "conversation": conv["id"], "tools": [PATCH],
                                                         "background": True, "input": "Now patch it."}).json()
        assert queued["status"] in ("queued", "in_progress") and queued["background"] is True
        deadline = time.monotonic() + 10
        while True:
            r2 = httpx.get(url + f"/v1/responses/{queued['id']}").json()
            if r2["status"] not in ("queued", "in_progress"):
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r2["status"] == "completed" and r2["output"][0]["type"] == "custom_tool_call"
        ctc = r2["output"][0]
        r3 = httpx.post(url + "/v1/responses", json={"model": "tiny", "conversation": conv["id"], "tools": [PATCH],
                                                     "input": [{"type": "custom_tool_call_output",
                                                                "call_id": ctc["call_id"], "output": "applied"}]},
                        timeout=30).json()
        items = httpx.get(url + f"/v1/conversations/{conv['id']}/items", params={"order": "asc", "limit": 100}).json()
    assert r3["status"] == "completed"
    kinds = [i["type"] for i in items["data"]]
    assert kinds == ["message", "message", "mcp_list_tools", "mcp_call", "message",
                     "message", "custom_tool_call", "custom_tool_call_output", "message"], kinds
    assert items["data"][6]["id"] == ctc["id"] and ctc["id"].startswith("ctc_")  # the ctc_ id is kept
    assert items["data"][3]["output"] == "42"
    # the last turn's history went upstream in upstream form: the MCP call and the custom call as function calls
    history = up.bodies[-1]["input"]
    calls = [(i.get("name"), i.get("call_id")) for i in history if i.get("type") == "function_call"]
    assert (mcp_name("calc", "add"), items["data"][3]["id"]) in calls
    assert ("apply_patch", ctc["call_id"]) in calls
    assert not any(i.get("type", "").startswith("mcp_") for i in history)
