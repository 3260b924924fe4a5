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


async def test_the_drain_forgets_every_stream_it_watched(monkeypatch: Any) -> None:
    """A tenant who opens streams and leaves them mid-answer, or whose upstream breaks, leaves nothing in the drain's
    set of reading tasks: the pump registers each read itself (``Drain.enter``/``leave``), and a task left there
    would hold a shutdown's drain for its whole timeout and later be cancelled outside any read."""
    from gateway.engine.drain import Drain

    drains: list[Drain] = []

    class Watched(Drain):
        def __init__(self) -> None:
            super().__init__()
            drains.append(self)

    monkeypatch.setattr("gateway.server.app.Drain", Watched)
    text = VllmStream().start().message("msg_1", ["he", "llo"]).complete().body()
    frames = text.split(b"\n\n")
    never = asyncio.Event()

    async def stalled() -> Any:  # the upstream's first frames, then a model that thinks until the test ends
        yield b"\n\n".join(frames[:3]) + b"\n\n"
        await never.wait()

    async def broken() -> Any:
        yield b"\n\n".join(frames[:3]) + b"\n\n"
        raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        kind = orjson.loads(request.content)["input"]
        content = {"stall": stalled(), "break": broken()}.get(kind, text)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content)

    app = create_app(Settings(upstream_url="http://upstream.invalid", store="none"),
                     transport=httpx.MockTransport(handler))

    async def leave_after_first_frame(body: bytes) -> list[dict[str, Any]]:
        first = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await first.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    def request(kind: str) -> bytes:
        return orjson.dumps({"model": "tiny", "stream": True, "input": kind})

    async with app.router.lifespan_context(app):
        [drain] = drains
        for _ in range(3):
            done = b"".join(m.get("body", b"") for m in await _post(app, request("text")))
            assert b"response.completed" in done
            assert drain.active_reads == 0
            failed = b"".join(m.get("body", b"") for m in await _post(app, request("break")))
            assert b"response.failed" in failed
            assert drain.active_reads == 0
            left = await leave_after_first_frame(request("stall"))
            assert any(m.get("body") for m in left)  # it was streaming when the client left
            assert drain.active_reads == 0
        never.set()
