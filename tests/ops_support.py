"""Helpers for the operational tests: a real fake vLLM on loopback and a gateway whose app and server the
test can reach (readiness cache, drain, connections)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.config import Settings
from gateway.server import create_app
from gateway.upstream.replay import load_cassette
from tests.support import cassette, serve_in_thread


def cassette_frames(name: str) -> list[bytes]:
    """The recorded SSE body of a streamed cassette, one frame per element."""
    body = load_cassette(cassette(name)).interactions[0].body
    return [part + b"\n\n" for part in body.split(b"\n\n") if part.strip()]


def cassette_json(name: str) -> bytes:
    return load_cassette(cassette(name)).interactions[0].body


@dataclass
class FakeVllm:
    """A scriptable stand-in for vLLM's HTTP server (real sockets, so httpx's real timeouts apply).

    ``health``: an HTTP status for ``GET /health``, or ``"hang"``. Streams send ``frames`` with
    ``frame_delay`` seconds between them; after ``stall_after`` frames they stall for ``stall_for`` seconds.
    """

    stream_name: str = "text_stream"
    json_name: str = "text_nonstream"
    chat_stream_name: str = "chat_text_stream"
    chat_json_name: str = "chat_text_nonstream"
    health: int | str = 200
    frame_delay: float = 0.0
    stall_after: int | None = None
    stall_for: float = 0.0
    json_delay: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    health_calls: int = 0
    stopping: bool = False

    async def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            self.health_calls += 1
            if self.health == "hang":
                await self._sleep(30)
                return Response(status_code=200)
            return Response(status_code=int(self.health))

        async def metrics(request: Request) -> Response:
            return PlainTextResponse("# HELP vllm:num_requests_running Running.\n"
                                     "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")

        async def responses(request: Request) -> Response:
            body = await request.json()
            self.requests.append({"headers": dict(request.headers), "body": body})
            chat = request.url.path.endswith("/chat/completions")
            if not body.get("stream"):
                await self._sleep(self.json_delay)
                return Response(cassette_json(self.chat_json_name if chat else self.json_name),
                                media_type="application/json")
            frames = cassette_frames(self.chat_stream_name if chat else self.stream_name)

            async def gen() -> AsyncIterator[bytes]:
                for n, frame in enumerate(frames):
                    if self.stall_after is not None and n == self.stall_after:
                        await self._sleep(self.stall_for)
                    elif n and self.frame_delay:
                        await self._sleep(self.frame_delay)
                    yield frame

            return StreamingResponse(gen(), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            self.requests.append({"headers": dict(request.headers), "body": await request.body()})
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        return Starlette(routes=[
            Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models, methods=["GET", "POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/chat/completions", responses, methods=["POST"]),
        ])


@contextlib.contextmanager
def fake_vllm(fake: FakeVllm | None = None, port: int | None = None) -> Iterator[tuple[str, FakeVllm]]:
    fake = fake or FakeVllm()
    with serve_in_thread(fake.app(), port) as (url, _server):
        try:
            yield url, fake
        finally:
            fake.stopping = True  # before the server stops, so stalled handlers return at once


@contextlib.contextmanager
def gateway(upstream_url: str = "http://upstream.test", *, transport: httpx.AsyncBaseTransport | None = None,
            **overrides: Any) -> Iterator[tuple[str, Starlette, uvicorn.Server]]:
    settings = Settings(upstream_url=upstream_url, store="none").with_overrides(**overrides)
    app = create_app(settings, transport=transport, store=None)
    with serve_in_thread(app) as (url, server):
        yield url, app, server


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll until ``predicate()`` is true (synchronisation, not an assertion about timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
