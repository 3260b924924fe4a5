"""A finished stream leaves no async generator for the garbage collector to finalize.

A generator abandoned at a ``break`` keeps its ``finally`` (a drain-guard slot, an upstream iterator) until the
collector finds it and the event loop runs a task to close it — late, and once per response. The pump closes
its chain itself. Checked in-process (the ASGI app driven directly, a mock upstream answering the takeover's
two requests), with the collector off so nothing is hidden by it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson

from gateway.config import Settings
from gateway.server import create_app
from tests.vllm_frames import VllmStream, args_deltas

GRAMMAR = 'start: "ok" | "no"'


def _upstream() -> httpx.MockTransport:
    upstream = VllmStream().start().call("fc_00000000000000a1", "chatcmpl-tool-00000000000000a1", "answer",
                                         args_deltas({"input": "ok"}, pieces=3)).complete().body()
    chat = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in [
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
         "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]) + b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        body = upstream if request.url.path.endswith("/responses") else chat
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return httpx.MockTransport(handler)


async def _post(app: Callable[..., Awaitable[None]], body: bytes) -> list[dict[str, Any]]:
    done = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await done.wait()  # as uvicorn: a disconnect only once the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "state": {}}
    await app(scope, receive, send)
    return sent


async def test_a_completed_takeover_stream_leaves_no_generator_to_finalize() -> None:
    app = create_app(Settings(upstream_url="http://upstream.invalid", store="none"), transport=_upstream())
    body = orjson.dumps({"model": "tiny", "stream": True, "input": "hi", "tool_choice": "auto", "tools": [
        {"type": "custom", "name": "answer", "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}]})
    loop = asyncio.get_running_loop()
    async with app.router.lifespan_context(app):
        await _post(app, body)  # warm-up (imports, the grammar)
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                sent = await _post(app, body)
                stream = b"".join(m.get("body", b"") for m in sent)
                assert b"response.custom_tool_call_input.delta" in stream and b"response.completed" in stream
            await asyncio.sleep(0)
            # BaseEventLoop keeps every started async generator in _asyncgens until it is closed or collected
            left = [a.ag_code.co_qualname for a in loop._asyncgens  # type: ignore[attr-defined]
                    if a.ag_code.co_qualname != "create_app.<locals>.lifespan"]
            assert left == []
        finally:
            gc.enable()
