"""One producer, three doors: the same scripted upstream answered over SSE, over the WebSocket and as a background
response resumed (``GET …?stream=true``) gives the same event sequence — types, sequence numbers and payloads —
once the per-response values (the response's id and creation time, the ``background`` flag) are set aside.

The upstream is a real loopback server (tests/test_websocket.py's ``ScriptedUpstream``) writing vLLM 0.32's
framing; the answer mixes frames the gateway passes through untouched (message text) with frames it rewrites (a
custom tool's call, its input decoded from the JSON argument deltas).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.config import Settings
from gateway.store.sqlite import SqliteResponseStore
from tests.invariants import check_stream
from tests.support import running_gateway, serve_in_thread, sse_events
from tests.test_websocket import PATCH, ScriptedUpstream, read_response, ws
from tests.vllm_frames import VllmStream, args_deltas

PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
REQUEST = {"model": "tiny", "input": "Patch it, then check the weather.", "tools": [PATCH_TOOL, WEATHER],
           "metadata": {"k": "v"}}


def answer(body: dict[str, Any], stream: VllmStream) -> None:
    stream.message("msg_00000000000000d1", ["I will ", "patch it ", "now."])
    stream.call("fc_00000000000000d2", "chatcmpl-tool-00000000000000d2", "apply_patch",
                args_deltas({"input": PATCH}, pieces=12))
    stream.call("fc_00000000000000d3", "chatcmpl-tool-00000000000000d3", "get_weather",
                args_deltas({"city": "Paris"}, pieces=4))


def normalized(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with what differs per response by design replaced: its id, created_at, the background flag."""
    rid = events[0]["response"]["id"]

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()
                    if k != "background" and not (k == "created_at" and "object" in value)}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return "<response id>" if value == rid else value

    return [walk(e) for e in events]


def test_sse_websocket_and_background_resume_give_the_same_events(tmp_path: Path) -> None:
    upstream = ScriptedUpstream(answer)
    settings = Settings(upstream_url="http://unused", store="none", tool_choice_enforcement="off")
    with serve_in_thread(upstream.app()) as (up_url, _), \
            running_gateway(settings.with_overrides(upstream_url=up_url),
                            store=SqliteResponseStore(tmp_path / "r.db")) as url:
        r = httpx.post(url + "/v1/responses", json={**REQUEST, "stream": True}, timeout=30)
        assert r.status_code == 200
        over_sse = sse_events(r.content)

        with ws(url) as conn:
            conn.send(json.dumps({"type": "response.create", **REQUEST}))
            over_ws = read_response(conn)

        created = httpx.post(url + "/v1/responses", json={**REQUEST, "background": True}, timeout=30).json()
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/v1/responses/{created['id']}", timeout=10).json()["status"] in ("queued",
                                                                                              "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        resumed = httpx.get(f"{url}/v1/responses/{created['id']}", params={"stream": "true"}, timeout=30)
        assert resumed.status_code == 200
        over_background = sse_events(resumed.content)

    summary = check_stream(over_sse, REQUEST)
    assert [i["type"] for i in summary["items"]] == ["message", "custom_tool_call", "function_call"]
    assert summary["items"][1]["input"] == PATCH
    assert [e["sequence_number"] for e in over_sse] == list(range(len(over_sse)))
    assert normalized(over_ws) == normalized(over_sse)
    assert normalized(over_background) == normalized(over_sse)
    assert len(upstream.requests) == 3
