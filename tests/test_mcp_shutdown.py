"""SIGTERM while a gateway-executed MCP call runs: the call gets the drain period, then fails, and the response
ends with ``response.failed`` (gateway_shutting_down); the process exits 0.

A real gateway process, the real MCP fixture server (its ``sleep`` tool outlasts the drain), and an upstream
SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py) served over TCP.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import TYPE_CHECKING, Any

import httpx

from gateway.translate.mcp_items import mcp_name
from tests.fake_upstream import serving
from tests.support import sse_events
from tests.test_ops_shutdown import gateway_process
from tests.vllm_frames import VllmStream

if TYPE_CHECKING:
    from tests.mcp_servers import McpTestServer

pytest_plugins = ["tests.mcp_servers"]


def _upstream(request: httpx.Request) -> httpx.Response:
    s = VllmStream().start()
    s.call("fc_00000000000000d1", "call_d1", mcp_name("slow", "sleep"), [json.dumps({"seconds": 30})])
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=s.complete().body())


def test_sigterm_fails_a_running_mcp_call_after_the_drain(mcp_fixture_server: McpTestServer) -> None:
    with serving(httpx.MockTransport(_upstream)) as up, \
            gateway_process(up, GATEWAY_MCP_ALLOWED_HOSTS="127.0.0.1", GATEWAY_DRAIN_TIMEOUT="1") as (url, proc):
        tool = {"type": "mcp", "server_label": "slow", "server_url": mcp_fixture_server.url,
                "require_approval": "never", "allowed_tools": ["sleep"]}
        result: dict[str, Any] = {}

        def run() -> None:
            r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "tools": [tool],
                                                        "stream": True}, timeout=60)
            result["events"] = sse_events(r.content)

        # The fixture server is shared by the session and other tests call `sleep` too: wait for this call.
        before = len(mcp_fixture_server.calls())
        client = threading.Thread(target=run)
        client.start()
        deadline = 0
        while not any(c["tool"] == "sleep" for c in mcp_fixture_server.calls()[before:]):
            deadline += 1
            assert deadline < 200, "the call never reached the server"
            threading.Event().wait(0.05)
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        assert proc.wait(30) == 0
    events = result["events"]
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "gateway_shutting_down"
    call = next(i for i in events[-1]["response"]["output"] if i["type"] == "mcp_call")
    assert call["status"] == "failed" and call["error"]["type"] == "http_error" and call["error"]["code"] == 503
