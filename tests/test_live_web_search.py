"""Opt-in: a pinned web search against the live tiny vLLM (``pytest -m live_vllm``; serve.sh must be running) and
the demo provider (a fixed local corpus, no network).

The tiny model has random weights: its query is gibberish, but under the default ``constrain`` mode the search
call's arguments are generated under the search function's schema, so the gateway gets a ``{"query": …}`` string,
searches, shows a ``web_search_call`` and sends the results back to vLLM for the answer round.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from openai.types.responses import ResponseFunctionWebSearch

from gateway.config import Settings
from tests.support import running_gateway

pytestmark = pytest.mark.live_vllm
LIVE = os.environ.get("GATEWAY_LIVE_VLLM_URL", "http://127.0.0.1:8011")


def test_live_pinned_web_search_runs_and_the_model_answers() -> None:
    try:
        httpx.get(LIVE + "/health", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"no live vLLM at {LIVE} ({exc!r}); start ../shared/tools/tiny-vllm/serve.sh 8011")
    settings = Settings(upstream_url=LIVE, store="none", web_search_provider="demo", max_tool_rounds=1)
    bodies = []
    with running_gateway(settings) as url:
        # The random model pads its JSON with whitespace and writes bytes that are not JSON in its strings, or is
        # cut off before the arguments close: try a few seeds until a search ran and the model answered after it.
        for seed in range(1, 7):
            r = httpx.post(url + "/v1/responses", timeout=300, json={
                "model": "tiny", "input": "Search the web for the responses gateway.", "seed": seed,
                "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}, "max_output_tokens": 1200,
                "include": ["web_search_call.action.sources"]})
            assert r.status_code == 200, r.text
            bodies.append(r.json())
            if [i["type"] for i in bodies[-1]["output"]][:2] == ["web_search_call", "message"]:
                break
    for body in bodies:  # whatever the model wrote, the call is OpenAI's shape
        call = body["output"][0]
        assert call["type"] == "web_search_call" and call["id"].startswith("ws_"), body["output"]
        ResponseFunctionWebSearch.model_validate(call)
        assert call["status"] in ("completed", "failed", "incomplete")
    body = bodies[-1]
    # a search that ran (or failed, the model told why) and a second round on the real vLLM: the loop went on
    assert [i["type"] for i in body["output"]][:2] == ["web_search_call", "message"], json.dumps(
        [b["output"][0] for b in bodies])[:2000]
    assert body["output"][0]["status"] in ("completed", "failed")
    assert body["status"] in ("completed", "incomplete")
