"""Small ASGI pieces: bounded body reading, OpenAI-shaped errors, and an SSE response that notices a
client leaving while the upstream is silent (so the upstream request is closed at once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, PayloadTooLarge

__all__ = ["OrjsonResponse", "SseResponse", "error_response", "read_body"]


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: GatewayError, headers: Mapping[str, str] | None = None) -> OrjsonResponse:
    return OrjsonResponse(exc.body(), status_code=exc.status, headers={**exc.headers, **(headers or {})})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is {declared} bytes; the limit is {limit} bytes.",
                              param=None)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    return bytes(buf)


_WRITE_BUFFER_LIMIT = 256 * 1024


class SseResponse(Response):
    """Streams ``body`` as ``text/event-stream`` and cancels it when the client disconnects.

    Starlette's StreamingResponse only notices a disconnect when a write fails (ASGI spec 2.4 servers), but
    the upstream may be silent for a long time while the model thinks; listening on ``receive`` makes the
    disconnect cancel the pump immediately, and the pump's ``finally`` closes the upstream request.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None,
                 on_disconnect: Callable[[], Awaitable[None] | None] | None = None) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.on_disconnect = on_disconnect
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        body_done = False  # a client closing after the last frame is a normal end, not a disconnect

        async def watch(scope_: anyio.CancelScope) -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = not body_done
                    scope_.cancel()
                    return

        # The body is produced in its own task and written by this one: whatever frames arrive while a write is
        # in flight go out together in the next write, so a burst of upstream frames costs one send, while a
        # lone frame is written as soon as the producer waits on the upstream again (nothing is held back).
        pending: list[bytes] = []
        buffered = 0
        produced_all = False
        ready = asyncio.Event()
        room = asyncio.Event()
        room.set()

        async def produce() -> None:
            nonlocal buffered, produced_all
            try:
                async for chunk in self.body_iterator:
                    pending.append(chunk)
                    buffered += len(chunk)
                    ready.set()
                    if buffered > _WRITE_BUFFER_LIMIT:  # a slow client: stop reading the upstream for now
                        room.clear()
                        await room.wait()
            finally:
                produced_all = True
                ready.set()

        async def stream(scope_: anyio.CancelScope) -> None:
            nonlocal body_done, buffered
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                if not pending and not produced_all:
                    await ready.wait()
                ready.clear()
                if pending:
                    data = b"".join(pending) if len(pending) > 1 else pending[0]
                    pending.clear()
                    buffered = 0
                    room.set()
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    continue
                if produced_all:
                    break
            body_done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                tg.start_soon(produce)
                await stream(tg.cancel_scope)
        except OSError:
            disconnected = not body_done
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        if disconnected and self.on_disconnect is not None:
            result = self.on_disconnect()
            if result is not None:
                await result
