"""The logs: one JSON line per request with the useful fields, and never a prompt, tool input or key."""

from __future__ import annotations

import json
import signal

import httpx
import structlog

from gateway.engine.record import RequestRecord
from gateway.server.observe import Observer
from tests.ops_support import FakeVllm, fake_vllm, gateway
from tests.test_ops_shutdown import gateway_process

GATEWAY_KEY = "gw-SECRET-key-1a2b3c"
UPSTREAM_KEY = "up-SECRET-key-4d5e6f"
WRONG_KEY = "wrong-SECRET-key-7g8h"
PROMPT = "PROMPT-SECRET-please-do-not-log"
TOOL_INPUT = "*** Begin Patch TOOL-INPUT-SECRET"
TOOL_OUTPUT = "TOOL-OUTPUT-SECRET"
SECRETS = (GATEWAY_KEY, UPSTREAM_KEY, WRONG_KEY, PROMPT, TOOL_INPUT, TOOL_OUTPUT, "Bearer")

APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}


def conversation(stream: bool) -> dict[str, object]:
    return {"model": "tiny", "stream": stream, "tools": [APPLY_PATCH], "input": [
        {"role": "user", "content": PROMPT},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": TOOL_INPUT},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": TOOL_OUTPUT},
    ]}


def test_subprocess_logs_are_json_lines_without_prompts_tool_inputs_or_keys() -> None:
    fake = FakeVllm()
    env = {"GATEWAY_API_KEYS": f"other-key,{GATEWAY_KEY}", "GATEWAY_UPSTREAM_API_KEY": UPSTREAM_KEY,
           "GATEWAY_LOG_LEVEL": "debug"}  # debug: the most the gateway ever logs
    with fake_vllm(fake) as (up, _), gateway_process(up, **env) as (url, proc):
        auth = {"authorization": f"Bearer {GATEWAY_KEY}"}
        r1 = httpx.post(url + "/v1/responses", json=conversation(True), headers={**auth, "x-request-id": "rid-1"})
        r2 = httpx.post(url + "/v1/responses", json=conversation(False), headers=auth)
        r3 = httpx.post(url + "/v1/responses", json=conversation(False),
                        headers={"authorization": f"Bearer {WRONG_KEY}", "x-request-id": "rid-3"})
        r4 = httpx.post(url + "/v1/responses", content=PROMPT.encode(), headers=auth)  # not JSON: 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert (r1.status_code, r2.status_code, r3.status_code, r4.status_code) == (200, 200, 401, 400)
    assert r1.headers["x-request-id"] == "rid-1" and r2.headers["x-request-id"].startswith("req_")
    # the secrets did travel: vLLM got the prompt and the tool input, so their absence below means something
    sent = json.dumps([req["body"] for req in fake.requests])
    assert PROMPT in sent and TOOL_OUTPUT in sent
    assert fake.requests[0]["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"

    for secret in SECRETS:
        assert secret not in stderr, secret
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # every line is JSON
    access = {line["request_id"]: line for line in lines if line["event"] == "request"}
    first = access["rid-1"]
    assert first["route"] == "/v1/responses" and first["model"] == "tiny" and first["status"] == 200
    assert first["stream"] is True and first["ttfb_ms"] > 0 and first["duration_ms"] >= first["ttfb_ms"]
    assert first["input_tokens"] is not None and first["output_tokens"] is not None
    assert first["tool_calls"] == {"custom": 0, "function": 0, "builtin": 0}
    assert access["rid-3"]["status"] == 401 and access["rid-3"]["error_code"] == "invalid_api_key"
    sizes = [line for line in lines if line["event"] == "payload_sizes"]
    assert sizes and all(set(line) <= {"event", "level", "timestamp", "pid", "request_id", "request_bytes",
                                       "response_bytes"} for line in sizes)
    # Every line says which process wrote it (--workers N: which worker), uvicorn's own lines included.
    assert {line.get("pid") for line in lines} == {proc.pid}
    assert len([line for line in lines if line["event"] == "request"]) == 4


def test_access_line_is_built_from_an_explicit_field_list() -> None:
    record = RequestRecord(request_id="r1", route="/v1/responses", status=200, model="m" * 500,
                           usage={"input_tokens": 3, "output_tokens": 4, "secret": PROMPT})
    with structlog.testing.capture_logs() as logs:
        Observer().end(record)
    [line] = [entry for entry in logs if entry["event"] == "request"]
    assert line["input_tokens"] == 3 and line["output_tokens"] == 4 and len(line["model"]) == 128
    assert PROMPT not in repr(logs)


def test_request_id_is_taken_from_the_client_or_generated() -> None:
    with fake_vllm() as (up, _), gateway(up) as (url, _app, _server):
        given = httpx.get(url + "/v1/models", headers={"x-request-id": "abc-123"})
        made = httpx.get(url + "/v1/models")
        bogus = httpx.get(url + "/v1/models", headers={"x-request-id": "x" * 500})
    assert given.headers["x-request-id"] == "abc-123"
    assert made.headers["x-request-id"].startswith("req_")
    assert bogus.headers["x-request-id"].startswith("req_")
