"""Codex CLI as a judge of compaction: a session that crosses the model catalog's ``auto_compact_token_limit``
compacts through the gateway and keeps working after it.

Codex compacts remotely (``POST /v1/responses/compact``, or a ``compaction_trigger`` in its newer engine) only for
a provider it takes for OpenAI's or Azure's (codex-rs ``ModelProviderInfo::supports_remote_compaction``: its
``name`` is ``OpenAI``, or ``azure`` in any case, or its base URL is an Azure one); for any other provider it
summarizes locally with ordinary turns. Both are judged: a provider named ``OpenAI``, and one named otherwise. The
scripted upstream is SYNTHESIZED in vLLM 0.32's framing (tests/vllm_frames.py), as in tests/test_codex_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from structlog.testing import capture_logs

from gateway.config import Settings
from gateway.translate.compaction_prompt import COMPACTION_INSTRUCTIONS
from tests.support import running_gateway, serve_in_thread
from tests.test_codex_cli import CODEX_BIN, CODEX_TIMEOUT, PATCH, chat_chunks, codex, tiny_model_entry
from tests.vllm_frames import VllmStream, args_deltas

__all__ = ["codex"]  # the session fixture, shared with tests/test_codex_cli.py

SUMMARY = "SUMMARY-c0d3x: hello.txt was being created with apply_patch."


class CompactingUpstream:
    """Turn 1: an apply_patch call. A summarization turn (the gateway's compaction instructions): SUMMARY,
    not streamed. Any later turn: a text message."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(("/v1/responses", body))
            n = len(self.requests)
            stream = VllmStream(f"resp_{n:016x}", tools=body.get("tools") or []).start()
            if body.get("instructions") == COMPACTION_INSTRUCTIONS:
                stream.message(f"msg_{n:016x}", [SUMMARY])
                return Response(stream.nonstream_body(), media_type="application/json")
            answers = [b for p, b in self.requests if p == "/v1/responses"
                       and b.get("instructions") != COMPACTION_INSTRUCTIONS]
            if len(answers) == 1:
                stream.call(f"fc_{n:016x}", f"chatcmpl-tool-{n:016x}", "apply_patch",
                            args_deltas({"input": PATCH}, 6))
            else:
                stream.message(f"msg_{n:016x}", ["Created ", "hello.txt."])
            return StreamingResponse(iter([f.encode() for f in stream.complete().frames]),
                                     media_type="text/event-stream")

        async def chat(request: Request) -> Response:
            self.requests.append(("/v1/chat/completions", json.loads(await request.body())))
            return StreamingResponse(iter(chat_chunks(args_deltas(PATCH, 8))), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"])])


def write_home(home: Path, gateway_url: str, provider_name: str) -> None:
    home.mkdir()
    entry = {**tiny_model_entry(), "auto_compact_token_limit": 100}  # each scripted turn reports 160 tokens
    catalog = home / "models.json"
    catalog.write_text(json.dumps({"models": [entry]}))
    (home / "config.toml").write_text(f"""\
model = "tiny"
model_provider = "gw"
model_catalog_json = {json.dumps(str(catalog))}
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.gw]
name = "{provider_name}"
base_url = "{gateway_url}/v1"
wire_api = "responses"
env_key = "GW_KEY"
supports_websockets = false
request_max_retries = 0
stream_max_retries = 0

[features]
plugins = false
apps = false

[analytics]
enabled = false
""")


@pytest.mark.parametrize("provider_name", ["OpenAI", "responses-gateway"])
def test_codex_compacts_through_the_gateway_and_keeps_working(codex: str, tmp_path: Path,
                                                              provider_name: str) -> None:
    """``OpenAI``: Codex compacts remotely, the gateway's model writes the summary. Any other name: Codex
    summarizes locally with an ordinary turn of its own (no tools, ``tool_choice: "auto"``) that the gateway
    serves, and goes on from its own summary."""
    upstream = CompactingUpstream()
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "codex-home"
    with serve_in_thread(upstream.app()) as (up_url, _), capture_logs() as logs, \
            running_gateway(Settings(upstream_url=up_url, store="none")) as url:
        write_home(home, url, provider_name)
        env = {**os.environ, "CODEX_HOME": str(home), "GW_KEY": "sk-gateway-test", "NO_COLOR": "1",
               "RUST_LOG": "warn"}
        command = [str(CODEX_BIN), "exec", "--strict-config", "--skip-git-repo-check",
                   "--dangerously-bypass-approvals-and-sandbox", "--json", "-C", str(work),
                   "Create hello.txt containing hi."]
        try:
            proc = subprocess.run(command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=CODEX_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"codex {codex} ran past {CODEX_TIMEOUT} s; upstream saw {len(upstream.requests)} "
                        f"request(s): {[p for p, _ in upstream.requests]}")
    seen = [(e.get("method"), e.get("route"), e.get("status")) for e in logs if e.get("event") == "request"]
    detail = f"codex {codex} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\nroutes: {seen}"
    assert proc.returncode == 0, detail
    assert (work / "hello.txt").read_text() == "hi\n", detail
    routes = [e.get("route") for e in logs if e.get("event") == "request"]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["type"] == "turn.completed", detail
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages == ["Created hello.txt."], detail
    assert all(e["status"] == 200 for e in logs if e.get("event") == "request"), detail
    summarizations = [b for p, b in upstream.requests if b.get("instructions") == COMPACTION_INSTRUCTIONS]
    if provider_name != "OpenAI":  # local: Codex's own summarization turn, the gateway's never ran
        assert summarizations == [] and "/v1/responses/compact" not in routes, detail
        assert any(p == "/v1/responses" and not b.get("tools") for p, b in upstream.requests), detail
        return
    # Codex compacted through the gateway (0.171: a compaction_trigger on /v1/responses; older ones call
    # /v1/responses/compact): the upstream model wrote the summary, once
    assert len(summarizations) == 1 and summarizations[0]["model"] == "tiny", detail
    assert "Create hello.txt" in json.dumps(summarizations[0]["input"]), detail
    # ... and kept working: the next turn got the summary in place of the compaction item, never its blob
    later = [b for p, b in upstream.requests if p == "/v1/responses" and SUMMARY in json.dumps(b.get("input"))
             and b.get("instructions") != COMPACTION_INSTRUCTIONS]
    assert later, detail
    for body in later:
        assert not any(isinstance(i, dict) and (i.get("type") == "compaction" or "encrypted_content" in i)
                       for i in body["input"]), detail
