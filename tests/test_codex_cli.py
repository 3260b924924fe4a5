"""Codex CLI as a judge: ``codex exec``, set up by ``responses-gateway codex-config --write`` alone, applies a patch
and answers — over the gateway's WebSocket mode and over HTTP.

Codex (pinned in ``tests/codex/package.json`` / ``package-lock.json``, installed with ``npm ci`` on first use;
the npm package ships its native binary in an optional per-platform package) gets a fresh ``CODEX_HOME`` holding
only what ``codex-config --write`` wrote: the provider block for the gateway (``supports_websockets`` true, or
false with ``--no-websockets``) and the model catalog built from the gateway's ``/v1/models``, whose entry for
``tiny`` says ``apply_patch_tool_type: "freeform"`` — so Codex sends ``apply_patch`` as a ``custom`` tool with its
Lark grammar, as it does for OpenAI's models. Its approvals and sandbox are switched off on the command line.

The gateway runs with its defaults (``tool_choice_enforcement = constrain``, ``tool_call_parser = auto``) in front
of an upstream that says it is vLLM 0.32 (``GET /version``): Codex's ``apply_patch`` grammar is regular, so the
gateway sends the tool ``strict`` with its grammar as the ``input`` pattern and vLLM constrains the call in the
one request (README "Grammar custom tools under auto"): one upstream request per turn, no takeover step.
The scripted upstream is a real loopback server; its /v1/responses streams are SYNTHESIZED in vLLM 0.32's
framing (``tests/vllm_frames.py``); its chat route (the takeover's step, unused here) answers in vLLM 0.32's chunk
framing (``cassettes/vllm/chat_structured_grammar_stream.yaml``). Neither is a recording of a real vLLM.

``node`` and ``npm`` are required: without them this test fails rather than skips, so CI runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from structlog.testing import capture_logs

from gateway.codex_config import ServedModel, catalog_entry
from gateway.config import Settings
from gateway.translate.grammar_convert import to_json_pattern
from tests.support import npm_packages, running_gateway, serve_in_thread
from tests.vllm_frames import VllmStream, _dumps, args_deltas

CODEX = Path(__file__).resolve().parent / "codex"
CODEX_BIN = CODEX / "node_modules" / ".bin" / "codex"
CODEX_TIMEOUT = 45
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
GATEWAY_KEY = "sk-gateway-test"
# the scripted vLLM's max_model_len: the catalog's context window (the scripted usage stays far below it)
CONTEXT_WINDOW = 32768


# --- node, npm and the pinned Codex -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def codex() -> str:
    """The pinned Codex CLI (``npm ci`` in tests/codex when node_modules is missing or stale); its version."""
    npm_packages(CODEX, "the Codex CLI test")
    proc = subprocess.run([str(CODEX_BIN), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:  # e.g. no native binary for this platform in the optional packages
        pytest.fail(f"codex --version failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    pinned = json.loads((CODEX / "package.json").read_text())["dependencies"]["@openai/codex"]
    assert proc.stdout.split()[-1] == pinned, proc.stdout
    return pinned


# --- the scripted upstream ------------------------------------------------------------------------------------------


def chat_chunks(pieces: list[str], *, chat_id: str = "chatcmpl-00000000000000c1") -> list[bytes]:
    """A vLLM 0.32 /v1/chat/completions stream of content ``pieces`` (SYNTHESIZED; framing as recorded in
    cassettes/vllm/chat_structured_grammar_stream.yaml): role chunk, content chunks, finish, usage, [DONE]."""
    head = {"id": chat_id, "object": "chat.completion.chunk", "created": 1795973040, "model": "tiny"}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        return f"data: {_dumps({**head, 'choices': [choice], **extra})}\n\n".encode()

    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 300, "total_tokens": 340, "completion_tokens": 40},
             "system_fingerprint": "vllm-0.32.0-ed9cb571"}
    return [f"data: {_dumps(first)}\n\n".encode(), *(chunk({"content": p}) for p in pieces),
            chunk({}, "stop"), f"data: {_dumps(usage)}\n\n".encode(), b"data: [DONE]\n\n"]


def _has_tool_output(body: dict[str, Any]) -> bool:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)


class CodexUpstream:
    """Turn 1: an apply_patch call (the gateway sent it as a strict function taking {"input": ...} with the grammar
    as its pattern). Turn 2 (the patch's output in the input): a text message."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(("/v1/responses", body))
            n = sum(p == "/v1/responses" for p, _ in self.requests)
            stream = VllmStream(f"resp_{n:016x}", tools=body.get("tools") or []).start()
            if _has_tool_output(body):
                stream.message("msg_00000000000000d2", ["Created ", "hello.txt."])
            else:
                stream.call("fc_00000000000000d1", "chatcmpl-tool-00000000000000d1", "apply_patch",
                            args_deltas({"input": PATCH}, 6))
            return StreamingResponse(iter([f.encode() for f in stream.complete().frames]),
                                     media_type="text/event-stream")

        async def chat(request: Request) -> Response:
            self.requests.append(("/v1/chat/completions", json.loads(await request.body())))
            return StreamingResponse(iter(chat_chunks(args_deltas(PATCH, 8))), media_type="text/event-stream")

        async def models(request: Request) -> Response:  # vLLM 0.32's ModelCard fields (HAND-WRITTEN)
            return JSONResponse({"object": "list", "data": [
                {"id": "tiny", "object": "model", "created": 1795973040, "owned_by": "vllm", "root": "tiny",
                 "parent": None, "max_model_len": CONTEXT_WINDOW, "permission": []}]})

        async def version(request: Request) -> Response:
            return JSONResponse({"version": "0.32.0"})

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"]),
                                 Route("/version", version, methods=["GET"])])


# --- Codex's configuration: only what codex-config wrote -----------------------------------------------------------


def tiny_model_entry() -> dict[str, Any]:
    """The catalog entry codex-config writes for the scripted ``tiny`` (for tests that hand-write a Codex home)."""
    return catalog_entry(ServedModel("tiny", CONTEXT_WINDOW))


def write_codex_home(home: Path, gateway_url: str) -> None:
    """A Codex home for the gateway, as a user gets it (for tests that need one and judge something else)."""
    codex_config_home(home, gateway_url, websockets=True)


def codex_config_home(home: Path, gateway_url: str, *, websockets: bool) -> str:
    """A fresh Codex home set up by ``responses-gateway codex-config --write`` (a subprocess, as a user runs it)
    and nothing else; its stderr."""
    command = [sys.executable, "-m", "gateway", "codex-config", "--gateway-url", gateway_url, "--codex-home",
               str(home), "--api-key-env", "GW_KEY", "--write", *([] if websockets else ["--no-websockets"])]
    proc = subprocess.run(command, env={**os.environ, "GW_KEY": GATEWAY_KEY}, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in home.iterdir()) == ["config.toml", "responses-gateway-models.json"]
    return proc.stderr


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_codex_exec_applies_a_patch_set_up_by_codex_config(codex: str, tmp_path: Path, transport: str) -> None:
    upstream = CodexUpstream()
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "codex-home"
    websockets = transport == "websocket"
    with serve_in_thread(upstream.app()) as (up_url, _), capture_logs() as logs, \
            running_gateway(Settings(upstream_url=up_url, store="none",  # default enforcement
                                     api_keys=(GATEWAY_KEY,))) as url:
        codex_config_home(home, url, websockets=websockets)
        env = {**os.environ, "CODEX_HOME": str(home), "GW_KEY": GATEWAY_KEY, "NO_COLOR": "1", "RUST_LOG": "warn"}
        # --strict-config: a key this Codex does not know fails the run (config drift on an upgrade shows)
        command = [str(CODEX_BIN), "exec", "--strict-config", "--skip-git-repo-check",
                   "--dangerously-bypass-approvals-and-sandbox", "--json", "-C", str(work),
                   "Create hello.txt containing hi."]
        try:
            proc = subprocess.run(command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=CODEX_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
            err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
            pytest.fail(f"codex {codex} ran past {CODEX_TIMEOUT} s; upstream saw {len(upstream.requests)} "
                        f"request(s):\n{(out or '')[-3000:]}\n{(err or '')[-3000:]}")
        metrics = httpx.get(url + "/metrics").text
    detail = f"codex {codex} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    assert (work / "hello.txt").read_text() == "hi\n", detail
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["type"] == "turn.completed", detail
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages == ["Created hello.txt."], detail
    ws_messages = [line for line in metrics.splitlines()
                   if line.startswith('responses_gateway_websocket_messages_total{type="response.create"}')]
    access = [e for e in logs if e.get("event") == "request" and e.get("route") == "/v1/responses"]
    assert all(e["status"] == 200 for e in access), access
    if websockets:  # Codex spoke WebSocket mode: every response went over the socket, none over POST
        assert ws_messages and float(ws_messages[0].split()[-1]) >= 2, metrics
        assert len(access) >= 2 and {e["method"] for e in access} == {"WEBSOCKET"}, access
    else:  # supports_websockets = false: every turn a POST
        assert not ws_messages or float(ws_messages[0].split()[-1]) == 0, metrics
        assert len(access) >= 2 and {e["method"] for e in access} == {"POST"}, access
    # what Codex sent: apply_patch as a custom grammar tool, which the upstream saw as a function taking {"input"}
    paths = [p for p, _ in upstream.requests]
    assert paths == ["/v1/responses", "/v1/responses"], paths  # one request per turn: no takeover step
    first, second = (body for _, body in upstream.requests)
    # the catalog's entry is what Codex ran the model by: its base instructions (in the upstream prompt)
    assert "Edit files only with the `apply_patch` tool" in json.dumps(first), first
    [tool] = [t for t in first["tools"] if t.get("name") == "apply_patch"]
    assert tool["type"] == "function" and tool["parameters"]["required"] == ["input"], tool
    assert "Lark grammar" in tool["description"], tool
    grammar = tool["description"][tool["description"].index("start: begin_patch"):]  # Codex's own grammar
    assert tool["strict"] is True and "structured_outputs" not in first
    assert tool["parameters"]["properties"]["input"]["pattern"] == to_json_pattern("lark", grammar), tool
    # Codex (0.171) warms up with generate: false, then chains each turn with previous_response_id and store:
    # false, sending only the new items: the gateway's per-connection cache rebuilt the whole conversation
    history = second["input"]
    assert history[: len(first["input"])] == first["input"]
    assert [i.get("type", "message") for i in history[len(first["input"]):]] == ["function_call",
                                                                              "function_call_output"], history
    assert first["input"][0]["role"] == "developer"  # the warm-up's input (its instructions) came first
    [call] = [i for i in second["input"] if i.get("type") == "function_call"]
    assert call["name"] == "apply_patch" and json.loads(call["arguments"]) == {"input": PATCH}, call
    assert 'outcome="constrained"} 1.0' in metrics
    assert 'responses_gateway_grammar_enforcement_total{route="strict_pattern"}' in metrics
