"""Compaction against the real tiny vLLM (issue 20), on both upstream APIs (opt-in: ``pytest -m live_vllm``; the
tiny vLLM of serve.sh, random weights, a 2048-token window).

The summary of a random-weights model is noise; what is checked is the path: the summarization turn is accepted by
vLLM (both APIs), the sealed item comes back and is accepted on the next turn, the real context meter
(vLLM's /tokenize) triggers ``context_management``, and a ``compaction_trigger`` answers one compaction item.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.store import SqliteResponseStore
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events

LIVE = os.environ.get("GATEWAY_LIVE_VLLM_URL", "http://127.0.0.1:8011")
HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": "Read src/app.py and make it print goodbye."},
    {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{\"path\": \"src/app.py\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "print('hello')"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Changed it."}]},
    {"type": "message", "role": "user", "content": "Now the tests."},
]


@pytest.mark.live_vllm
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_compaction_on_the_real_tiny_vllm(api: str, tmp_path: Path) -> None:
    settings = Settings(upstream_url=LIVE, store="none", tool_choice_enforcement="off", upstream_api=api,
                        compaction_max_output_tokens=24)
    with running_gateway(settings, store=SqliteResponseStore(tmp_path / "r.db")) as url, \
            httpx.Client(base_url=url, timeout=300) as c:
        r = c.post("/v1/responses/compact", json={"model": "tiny", "input": HISTORY})
        assert r.status_code == 200, r.text
        compacted = r.json()
        item = compacted["output"][-1]
        assert item["type"] == "compaction" and item["encrypted_content"]
        assert compacted["usage"]["input_tokens"] > 100 and compacted["usage"]["output_tokens"] > 0

        nxt = c.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 8, "input": [
            *compacted["output"], {"role": "user", "content": "go on"}]})
        assert nxt.status_code == 200, nxt.text
        assert nxt.json()["status"] in ("completed", "incomplete")

        # context_management past a threshold the real meter counts (vLLM's /tokenize), streamed
        with c.stream("POST", "/v1/responses", json={
                "model": "tiny", "max_output_tokens": 8, "stream": True, "input": HISTORY,
                "context_management": [{"type": "compaction", "compact_threshold": 20}]}) as s:
            events = sse_events(s.read())
        check_stream(events)
        final = events[-1]["response"]
        assert final["output"][0]["type"] == "compaction", final
        assert "response.compaction.compacting" in [e["type"] for e in events]
        assert final["usage"]["input_tokens"] > compacted["usage"]["input_tokens"]  # both passes counted

        # below the threshold nothing is compacted
        plain = c.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 8, "input": "hi",
                                              "context_management": [{"type": "compaction",
                                                                      "compact_threshold": 1500}]}).json()
        assert all(i["type"] != "compaction" for i in plain["output"])

        trig = c.post("/v1/responses", json={"model": "tiny", "previous_response_id": final["id"],
                                             "input": [{"type": "compaction_trigger"}]})
        assert trig.status_code == 200, trig.text
        assert [i["type"] for i in trig.json()["output"]] == ["compaction"]
