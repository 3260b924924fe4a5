"""Opt-in: the gateway in front of the live tiny vLLM (``pytest -m live_vllm``; serve.sh must be running)."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from gateway.config import Settings
from tests.invariants import check_stream
from tests.support import running_gateway, sse_events

pytestmark = pytest.mark.live_vllm
LIVE = os.environ.get("GATEWAY_LIVE_VLLM_URL", "http://127.0.0.1:8011")
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


@pytest.fixture(scope="module")
def gateway_url():  # type: ignore[no-untyped-def]
    try:
        httpx.get(LIVE + "/health", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"no live vLLM at {LIVE} ({exc!r}); start ../shared/tools/tiny-vllm/serve.sh 8011")
    settings = Settings(upstream_url=LIVE, store="none", tool_choice_enforcement="off")
    with running_gateway(settings) as url:
        yield url


def test_live_custom_tool_call_through_the_strict_stream_helper(gateway_url: str) -> None:
    """The random model is often cut off mid-call: try seeds until one completes; every stream must parse."""
    c = openai.OpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=0)
    finals = []
    for seed in range(1, 9):
        with c.responses.stream(model="tiny", input="Create a patch.", tools=[PATCH], max_output_tokens=128,
                                tool_choice={"type": "custom", "name": "apply_patch"},
                                extra_body={"seed": seed}) as s:
            kinds = [e.type for e in s]
            if kinds[-1] == "response.completed":
                finals.append(s.get_final_response())
                break
    assert finals, "no seed gave a completed response"
    [call] = finals[0].output
    assert call.type == "custom_tool_call" and call.id.startswith("ctc_") and isinstance(call.input, str)


def test_live_raw_stream_meets_the_contract(gateway_url: str) -> None:
    body = {"model": "tiny", "input": "Create a patch.", "stream": True, "tools": [PATCH], "max_output_tokens": 64,
            "tool_choice": "required", "metadata": {"k": "v"}}
    r = httpx.post(gateway_url + "/v1/responses", json=body, timeout=120)
    summary = check_stream(sse_events(r.content), body)
    assert summary["terminal"] in ("response.completed", "response.incomplete")


def test_live_upstream_error_keeps_status_and_shape(gateway_url: str) -> None:
    r = httpx.post(gateway_url + "/v1/responses", json={"model": "no-such-model", "input": "x"}, timeout=60)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_live_models_are_proxied(gateway_url: str) -> None:
    assert httpx.get(gateway_url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
