"""Third-party JavaScript clients as judges: the Vercel AI SDK and the OpenAI Agents SDK for JS.

Each test runs a real gateway in front of a scripted upstream and a plain Node script from ``tests/js/``
(pinned in ``tests/js/package.json`` / ``package-lock.json``, installed with ``npm ci`` on first use), which
prints one JSON line with what the client observed. The clients' own parsers and schemas are the judges.

The scripted upstreams are SYNTHESIZED in vLLM 0.32's /v1/responses framing (``tests/vllm_frames.py``, built
from the recorded cassettes in ``cassettes/vllm/``), including the usage details vLLM 0.32 really sends
(``input_tokens_per_turn``, ``cached_tokens_per_turn``, ``tool_output_tokens``, ...) and its 400 error shape
for an input item it does not take (``item_reference``). They are not recordings of a real vLLM.

``node`` and ``npm`` are required: without them these tests fail rather than skip, so CI runs them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store import SqliteResponseStore
from tests.support import npm_packages, running_gateway
from tests.vllm_frames import VllmStream, _dumps, args_deltas

JS = Path(__file__).resolve().parent / "js"
SCRIPT_TIMEOUT = 30

# vLLM 0.32's usage object, as recorded (cassettes/vllm/*): the per-turn lists and tool_output_tokens included.
VLLM_USAGE = {
    "input_tokens": 120,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                             "cached_tokens_per_turn": []},
    "output_tokens": 40,
    "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                              "tool_output_tokens_per_turn": []},
    "total_tokens": 160,
}

PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+Hello, "world"!\n+\ttabbed \\ backslash\n*** End Patch\n'


# --- node, npm and the pinned packages ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def js_clients() -> Path:
    """``tests/js`` with its node_modules installed from the lock file (``npm ci``) when missing or stale."""
    npm_packages(JS, "the JavaScript client tests")
    return JS


def run_js(js: Path, script: str, url: str) -> dict[str, Any]:
    """Run one judge script against the gateway at ``url``; return the JSON line it printed."""
    node = shutil.which("node")
    assert node is not None
    proc = subprocess.run([node, str(js / script), url + "/v1"], cwd=js, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT, check=False, env={**os.environ, "NO_COLOR": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    observed: dict[str, Any] = json.loads(lines[-1])
    observed["_stderr"] = proc.stderr[-3000:]
    return observed


# --- the scripted upstream (synthesized, in vLLM 0.32's framing) ----------------------------------------------


class _Frames(httpx.AsyncByteStream):
    def __init__(self, frames: list[str]) -> None:
        self.frames = frames

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for frame in self.frames:
            yield frame.encode()


class ScriptedVllm(VllmStream):
    """A VllmStream whose terminal usage is vLLM 0.32's, per-turn lists and all."""

    def complete(self, status: str = "completed") -> ScriptedVllm:
        self.event("response.completed", {"response": self.final(status)})
        return self

    def final(self, status: str = "completed") -> dict[str, Any]:
        return {**self.response, "status": status, "output": self.output, "usage": VLLM_USAGE}


def _hex() -> str:
    return secrets.token_hex(8)


def vllm_error(status: int, message: str, param: str | None) -> httpx.Response:
    """vLLM's error body (cassettes/vllm/error_*): type is the HTTP reason, code the status."""
    reason = {400: "Bad Request", 404: "Not Found"}[status]
    body = {"error": {"message": message, "type": reason, "param": param, "code": status}}
    return httpx.Response(status, content=_dumps(body).encode(), headers={"content-type": "application/json"})


Answer = Callable[[dict[str, Any], ScriptedVllm], None]


class Upstream:
    """An httpx transport answering POST /v1/responses like vLLM 0.32 would, from a per-scenario ``answer``.

    Like vLLM, it refuses input items it does not know (``item_reference``): the gateway must resolve them.
    """

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/v1/responses":
            return vllm_error(404, f"Not Found: {request.url.path}", None)
        body = json.loads(request.content)
        self.requests.append(body)
        items = body.get("input") if isinstance(body.get("input"), list) else []
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("type") == "item_reference":
                return vllm_error(400, f"1 validation error:\n  {{'type': 'union_tag_invalid', 'loc': 'body.input.{i}'"
                                  ", 'msg': \"Input tag 'item_reference' found using 'type' does not match any of "
                                  "the expected tags\", 'input': '<dict of 2 items>'}", f"body.input.{i}")
        resp = ScriptedVllm(f"resp_{_hex()}", tools=body.get("tools") or [])
        resp.response.update(tool_choice=body.get("tool_choice", "auto"), model=body.get("model"))
        if body.get("stream"):
            resp.start()
            self.answer(body, resp)
            resp.complete()
            return httpx.Response(200, stream=_Frames(resp.frames),
                                  headers={"content-type": "text/event-stream; charset=utf-8"})
        self.answer(body, resp)
        return httpx.Response(200, content=_dumps(resp.final()).encode(), headers={"content-type": "application/json"})


def _has_tool_output(body: dict[str, Any]) -> bool:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)


def weather_loop(*, preamble: str | None) -> Answer:
    """Turn 1: (an optional message, then) a get_weather call; once a tool output is in the input: a text answer."""

    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        if _has_tool_output(body):
            resp.message(f"msg_{_hex()}", ["It is ", "sunny ", "in Paris."])
            return
        if preamble is not None:
            resp.message(f"msg_{_hex()}", [preamble])
        resp.call(f"fc_{_hex()}", f"chatcmpl-tool-{_hex()}", "get_weather", args_deltas({"city": "Paris"}, 4))

    return answer


def _tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("name") for t in body.get("tools") or []]


# --- scenarios --------------------------------------------------------------------------------------------------


def test_ai_sdk_streams_a_custom_tool_call_with_its_full_input(js_clients: Path) -> None:
    # Not named apply_patch: for that name the AI SDK sends tool_choice {"type": "apply_patch"} (OpenAI's hosted
    # tool), whatever the tool's kind.
    def answer(body: dict[str, Any], resp: ScriptedVllm) -> None:
        # the gateway sent write_patch as a strict function taking {"input": ...}; answer as vLLM would
        resp.call(f"fc_{_hex()}", f"chatcmpl-tool-{_hex()}", "write_patch", args_deltas({"input": PATCH}, 9))

    upstream = Upstream(answer)
    with running_gateway(transport=upstream.transport) as url:
        seen = run_js(js_clients, "ai_sdk_custom_tool_stream.mjs", url)
    [sent] = upstream.requests
    assert _tool_names(sent) == ["write_patch"], sent["tools"]
    assert sent["tools"][0]["type"] == "function" and sent["tools"][0]["parameters"]["required"] == ["input"]
    assert sent["tool_choice"] == {"type": "function", "name": "write_patch"}, sent["tool_choice"]
    assert seen.get("error") is None and seen["errors"] == [], seen
    assert seen["inputStart"]["toolName"] == "write_patch", seen
    assert "".join(seen["inputDeltas"]) == PATCH, seen
    [call] = seen["toolCalls"]
    assert call["toolName"] == "write_patch" and call["input"] == PATCH and not call["invalid"], seen
    assert call["itemId"].startswith("ctc_"), seen
    assert seen["finishReason"] == "tool-calls", seen
    assert seen["usage"]["inputTokens"] == VLLM_USAGE["input_tokens"], seen
    assert seen["ok"] is True, seen


def test_ai_sdk_tool_loop_with_the_default_store_resolves_item_references(js_clients: Path, tmp_path: Path) -> None:
    upstream = Upstream(weather_loop(preamble="Let me look that up."))
    with running_gateway(transport=upstream.transport, store=SqliteResponseStore(tmp_path / "r.db")) as url:
        seen = run_js(js_clients, "ai_sdk_tool_loop_store.mjs", url)
    assert seen.get("error") is None, seen
    assert seen["executed"] == ["Paris"], seen
    first, second = seen["steps"]
    assert first["toolCalls"] == [{"toolName": "get_weather", "input": {"city": "Paris"}}], seen
    # the client did what this test is about: store left on, turn 1's message sent back as a reference
    turn1, turn2 = seen["requests"]
    assert turn1["status"] == 200 and turn2.get("store") is not False, seen
    assert turn2["inputTypes"] == ["role:user", "item_reference", "function_call", "function_call_output"], seen
    assert turn2["status"] == 200, seen
    assert second["finishReason"] == "stop" and seen["text"] == "It is sunny in Paris.", seen
    assert seen["ok"] is True, seen
    # vLLM got turn 1's message itself in place of the reference
    assert len(upstream.requests) == 2
    history = upstream.requests[1]["input"]
    assert [i.get("type", "message") for i in history] == ["message", "message", "function_call",
                                                           "function_call_output"], history
    assert history[1]["role"] == "assistant" and "Let me look that up." in json.dumps(history[1]), history


def test_agents_sdk_streamed_run_calls_the_tool_and_answers(js_clients: Path) -> None:
    upstream = Upstream(weather_loop(preamble=None))
    with running_gateway(transport=upstream.transport) as url:
        seen = run_js(js_clients, "agents_stream_tool.mjs", url)
    assert seen.get("error") is None, seen
    assert seen["executed"] == ["Paris"], seen
    assert "tool_called:tool_call_item" in seen["events"] and "tool_output:tool_call_output_item" in seen["events"]
    assert seen["finalOutput"] == "It is sunny in Paris.", seen
    assert "response.completed" in seen["rawTypes"], seen
    assert seen["usage"]["requests"] == 2 and seen["usage"]["inputTokens"] == 2 * VLLM_USAGE["input_tokens"], seen
    assert seen["ok"] is True, seen
    assert len(upstream.requests) == 2 and _tool_names(upstream.requests[0]) == ["get_weather"]
    assert all(r["stream"] is True for r in upstream.requests)
