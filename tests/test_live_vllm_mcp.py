"""Opt-in: an MCP tool pinned by ``tool_choice`` against the live tiny vLLM (``pytest -m live_vllm``; serve.sh must
be running) and the real FastMCP fixture server (tests/mcp_servers.py).

The tiny model has random weights: what it writes is gibberish, but under the default ``constrain`` mode the call's
arguments are generated under the tool's input schema, so the MCP server gets two integers and adds them.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import httpx
import pytest

from gateway.config import Settings
from tests.support import running_gateway

if TYPE_CHECKING:  # imported by pytest as a plugin (below), so that its asserts are rewritten too
    from tests.mcp_servers import McpTestServer

pytest_plugins = ["tests.mcp_servers"]
pytestmark = pytest.mark.live_vllm
LIVE = os.environ.get("GATEWAY_LIVE_VLLM_URL", "http://127.0.0.1:8011")


def test_live_mcp_tool_choice_runs_the_call_on_the_server(mcp_fixture_server: McpTestServer) -> None:
    try:
        httpx.get(LIVE + "/health", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"no live vLLM at {LIVE} ({exc!r}); start ../shared/tools/tiny-vllm/serve.sh 8011")
    # the default enforcement (constrain); one round of calls, then the model answers with the tools withheld
    settings = Settings(upstream_url=LIVE, store="none", mcp_allowed_hosts=("127.0.0.1",), max_tool_rounds=1)
    before = len(mcp_fixture_server.calls())
    tool = {"type": "mcp", "server_label": "calc", "server_url": mcp_fixture_server.url, "require_approval": "never",
            "allowed_tools": ["add", "echo"]}
    bodies = []
    with running_gateway(settings) as url:
        # The random model pads its JSON with whitespace (the schema allows it) and is sometimes cut off by
        # max_output_tokens before the arguments close: try seeds until one call ran.
        for seed in range(1, 9):
            r = httpx.post(url + "/v1/responses", timeout=300, json={
                "model": "tiny", "input": "What is 2 + 3? Use the add tool.", "tools": [tool], "seed": seed,
                "max_output_tokens": 256, "tool_choice": {"type": "mcp", "server_label": "calc", "name": "add"}})
            assert r.status_code == 200, r.text
            bodies.append(r.json())
            if any(i["type"] == "mcp_call" and i["status"] in ("completed", "failed") for i in bodies[-1]["output"]):
                break
    body = bodies[-1]
    assert body["status"] in ("completed", "incomplete"), body
    types = [i["type"] for i in body["output"]]
    assert types[:2] == ["mcp_list_tools", "mcp_call"], types
    ran = mcp_fixture_server.calls()[before:]
    assert len(ran) == 1, f"no seed gave a call that ran: {[b['output'][1:] for b in bodies]}"
    listing, call = body["output"][:2]
    assert [t["name"] for t in listing["tools"]] == ["add", "echo"] and listing["error"] is None
    assert call["name"] == "add" and call["server_label"] == "calc" and call["id"].startswith("mcp_")
    args = json.loads(call["arguments"])  # constrained to {"a": int, "b": int}
    assert set(args) >= {"a", "b"} and all(isinstance(args[k], int) for k in ("a", "b")), call
    assert call["status"] == "completed" and call["output"] == str(args["a"] + args["b"]), call
    assert [(c["tool"], c["arguments"]) for c in ran] == [("add", {"a": args["a"], "b": args["b"]})]
    # the pin held for the first round only, and the bound stopped further calls
    assert types.count("mcp_call") == 1 or all(i.get("status") == "failed" for i in body["output"][2:]
                                                if i["type"] == "mcp_call")
