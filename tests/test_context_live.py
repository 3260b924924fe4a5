"""Token counts equal vLLM's own ``usage.input_tokens`` (issue 20), on both upstream APIs, for a request with
instructions, a developer message, tools, reasoning and a function call with its output.

Live (``pytest -m live_vllm``, the tiny vLLM of serve.sh): the gateway counts through vLLM's ``/tokenize``
(``POST /v1/responses/input_tokens``), then generates the same request; the two numbers must be equal. With
``GATEWAY_RECORD_CONTEXT_CASSETTES=1`` the live run also writes what went upstream and came back to
``cassettes/vllm/context_count_<api>.yaml``, which the default suite replays (``test_recorded_*``): the gateway
must still send vLLM the very ``/tokenize`` body it recorded, and the recorded count must equal the recorded
generation's usage."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.config import Settings
from gateway.upstream.replay import load_cassette
from tests.support import CASSETTES, replay, running_gateway

LIVE = os.environ.get("GATEWAY_LIVE_VLLM_URL", "http://127.0.0.1:8011")
APIS = ("responses", "chat")
TOOL = {"type": "function", "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Its path."}},
                       "required": ["path"]}}
ITEMS: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": "Follow the repository's rules."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read src/app.py, please."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "I should read the file first."}]},
    {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{\"path\": \"src/app.py\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "def main():\n    print('hello')\n"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "It prints hello.", "annotations": []}]},
    {"type": "message", "role": "user", "content": "Now make it print goodbye."},
]
REQUEST: dict[str, Any] = {"model": "tiny", "instructions": "You are a careful coding agent.", "input": ITEMS,
                           "tools": [TOOL], "max_output_tokens": 8, "store": False}


def _settings(api: str, upstream: str) -> Settings:
    return Settings(upstream_url=upstream, store="none", tool_choice_enforcement="off", upstream_api=api)


def _count_and_generate(url: str) -> tuple[int, int]:
    counted = httpx.post(url + "/v1/responses/input_tokens", json=REQUEST, timeout=120)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    generated = httpx.post(url + "/v1/responses", json=REQUEST, timeout=300)
    assert generated.status_code == 200, generated.text
    return counted.json()["input_tokens"], generated.json()["usage"]["input_tokens"]


class Recorder(httpx.AsyncBaseTransport):
    """The network, with every exchange kept (non-streamed ones only: enough for counting and generating)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        content = await request.aread()
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        self.exchanges.append({
            "request": {"body": content.decode() or None, "headers": {}, "method": request.method,
                        "uri": str(request.url)},
            "response": {"body": {"string": body.decode()}, "status": {"code": response.status_code,
                                                                     "message": response.reason_phrase},
                         "headers": {"content-type": [response.headers.get("content-type", "")]}},
        })
        return httpx.Response(response.status_code, headers={"content-type": response.headers.get(
            "content-type", "application/json")}, content=body)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def write(self, path: Path, api: str, counted: int, usage: int) -> None:
        now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        header = (f"# scenario: context_count_{api}\n# recorded: {now}"
                  f"\n# vllm-version: 0.32.0\n# upstream: {LIVE} model=tiny (tiny random-weight model, hermes tool "
                  f"parser, --max-model-len 2048)\n# request: the gateway's POST /v1/responses/input_tokens, then "
                  f"POST /v1/responses, with --upstream-api {api} (tests/test_context_live.py)\n"
                  f"# result: /tokenize count={counted}; generation usage input_tokens={usage}\n")
        path.write_text(header + yaml.safe_dump({"interactions": self.exchanges, "version": 1}, sort_keys=False,
                                                 allow_unicode=True, width=120), encoding="utf-8")


@pytest.mark.live_vllm
@pytest.mark.parametrize("api", APIS)
def test_live_counts_equal_vllms_own_usage(api: str) -> None:
    try:
        httpx.get(LIVE + "/health", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"no live vLLM at {LIVE} ({exc!r}); start ../shared/tools/tiny-vllm/serve.sh 8011")
    recorder = Recorder()
    with running_gateway(_settings(api, LIVE), transport=recorder) as url:
        counted, usage = _count_and_generate(url)
    assert counted == usage
    paths = [httpx.URL(e["request"]["uri"]).path for e in recorder.exchanges]
    assert paths.count("/tokenize") == 1  # the endpoint counted; the generation (below the guarded bound) did not
    assert paths[-1] == ("/v1/chat/completions" if api == "chat" else "/v1/responses")
    if os.environ.get("GATEWAY_RECORD_CONTEXT_CASSETTES") == "1":
        recorder.write(CASSETTES / "vllm" / f"context_count_{api}.yaml", api, counted, usage)


@pytest.mark.live_vllm
@pytest.mark.parametrize("api", APIS)
def test_live_auto_truncation_fits_the_real_window(api: str) -> None:
    """A history far past the tiny model's 2048 tokens: with truncation auto vLLM accepts it (its own usage within
    the window) and every call that remains has its output; disabled, the gateway refuses it."""
    items: list[dict[str, Any]] = []
    for t in range(25):
        items += [{"type": "message", "role": "user", "content": f"Read file {t}. " + "please " * 20},
                  {"type": "function_call", "call_id": f"call_{t}", "name": "read_file",
                   "arguments": f"{{\"path\": \"src/{t}.py\"}}"},
                  {"type": "function_call_output", "call_id": f"call_{t}", "output": "x = 1\n" * 20}]
    body = {**REQUEST, "input": [*ITEMS[:1], *items, ITEMS[-1]], "max_output_tokens": 16}
    with running_gateway(_settings(api, LIVE)) as url:
        refused = httpx.post(url + "/v1/responses", json=body, timeout=120)
        fitted = httpx.post(url + "/v1/responses", json={**body, "truncation": "auto"}, timeout=300)
        counted = httpx.post(url + "/v1/responses/input_tokens", json={**body, "truncation": "auto"}, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert fitted.status_code == 200, fitted.text
    usage = fitted.json()["usage"]["input_tokens"]
    assert usage + 16 <= 2048 and counted.json()["input_tokens"] == usage


@pytest.mark.parametrize("api", APIS)
def test_recorded_counts_equal_the_recorded_usage_and_the_tokenize_body_is_unchanged(api: str) -> None:
    name = f"context_count_{api}"
    recorded = load_cassette(CASSETTES / "vllm" / f"{name}.yaml")
    [tokenize] = [i for i in recorded.interactions if i.path == "/tokenize"]
    [generation] = [i for i in recorded.interactions if i.path.startswith("/v1/") and i.method == "POST"]
    usage = orjson.loads(generation.body)["usage"]
    recorded_usage = usage["prompt_tokens"] if api == "chat" else usage["input_tokens"]
    assert orjson.loads(tokenize.body)["count"] == recorded_usage
    transport = replay(name)
    with running_gateway(_settings(api, "http://upstream.test"), transport=transport) as url:
        counted, usage_now = _count_and_generate(url)
    assert counted == usage_now == recorded_usage
    sent = [r["body"] for r in transport.requests if r["path"] == "/tokenize"]
    assert sent == [tokenize.request_body]  # vLLM gets the very body it was recorded with
