"""Small ASGI pieces: bounded body reading, OpenAI-shaped errors, an SSE response that notices a client
leaving while the upstream is silent, and ``cancel_on_disconnect`` for handlers that answer in one piece —
either way a client that leaves closes its upstream request at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import GatewayError, InvalidRequest, PayloadTooLarge
from gateway.protocol.events import ClientEvent
from gateway.protocol.sse import encode_events
from gateway.server.decompress import body_decoder

__all__ = ["CLIENT_CLOSED_REQUEST", "BodyTimeout", "ClientLeft", "OrjsonResponse", "SseResponse", "buffer_body",
           "cancel_on_disconnect", "error_response", "list_query", "read_body"]

# nginx's status for "the client closed the connection before the answer": logged and counted, never sent.
CLIENT_CLOSED_REQUEST = 499


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: GatewayError, headers: Mapping[str, str] | None = None) -> OrjsonResponse:
    return OrjsonResponse(exc.body(), status_code=exc.status, headers={**exc.headers, **(headers or {})})


def list_query(query: Any) -> tuple[int, str]:
    """OpenAI's list parameters: ``limit`` (1-100, default 20) and ``order`` (``asc`` | ``desc``, default desc)."""
    raw = str(query.get("limit", "20"))
    # ASCII digits only (int() would also take "1_0", " 5" or other scripts' digits), and not too many.
    if not (raw.isascii() and raw.lstrip("-").isdigit() and len(raw) <= 20):
        raise InvalidRequest("'limit' must be an integer.", param="limit", code="invalid_type")
    limit = int(raw)
    if not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be between 1 and 100.", param="limit", code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    return limit, str(order)


class BodyTimeout(GatewayError):
    """The request body did not arrive within ``--body-read-timeout``."""

    status = 408
    code = "request_timeout"


class ClientLeft(Exception):
    """The client disconnected before its request body was complete."""


async def buffer_body(request: Request, limit: int, timeout: float) -> Request:
    """The request with its body already received: the wire bytes (still encoded) are read here, bounded by
    ``limit`` bytes (413) and ``timeout`` seconds in all (408), and the returned request replays them, so the
    handler's own reading (``read_body``, decompression, the proxy's stream) is unchanged. After the body,
    ``receive`` is the connection's again (disconnect watchers keep working).

    Why before the concurrency slot: a client trickling its body would otherwise hold a slot for as long as it
    likes, and a few such sockets refuse everyone else.
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is {declared} bytes; the limit is {limit} bytes.")
    receive = request.receive
    chunks: list[bytes] = []
    received = 0
    try:
        async with asyncio.timeout(timeout if timeout > 0 else None):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientLeft
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
                if chunk:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise BodyTimeout(f"The request body did not arrive within {timeout:g} seconds.",
                          headers={"connection": "close"}) from None
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return Request(request.scope, replay)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, decoded per its ``Content-Encoding`` (gateway.server.decompress), refusing (413) as
    soon as either the bytes received or the decoded body are known to exceed ``limit`` bytes."""
    decoder = body_decoder(request.headers.getlist("content-encoding"), limit)  # 415 before reading
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is {declared} bytes; the limit is {limit} bytes.",
                              param=None)
    buf = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        if decoder is None:
            buf += chunk
        else:
            await decoder.feed(chunk)
    return bytes(buf) if decoder is None else await decoder.finish()


async def cancel_on_disconnect(request: Request, handler: Callable[[Request], Awaitable[Response]], *,
                               when: Callable[[], bool] = lambda: True,
                               on_disconnect: Callable[[], None] | None = None) -> Response:
    """``handler(request)``, cancelled if the client disconnects before it returns.

    A non-streamed answer may wait minutes on the upstream; nothing reads the connection meanwhile, so a
    client that gives up would leave that upstream request (and vLLM's generation) running. Here, once the
    handler has read the whole request body (through a wrapped ``receive``), a watcher waits on the ASGI
    ``receive`` for ``http.disconnect`` and cancels the handler's task, whose cancellation closes the
    upstream request it is awaiting. ``when`` is asked as the body ends (after the handler parsed it):
    False skips the watcher — a streamed answer watches the connection itself from its first byte, so it
    costs nothing there. On a disconnect ``on_disconnect`` runs and the answer is a bodiless 499 (which no
    one receives; it is what the logs and metrics show).
    """
    task = asyncio.current_task()
    assert task is not None
    receive = request.receive
    loop = asyncio.get_running_loop()
    watcher: asyncio.Task[None] | None = None
    running = True
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        if running:
            left = True
            task.cancel()

    def start() -> None:  # runs once the handler is past the body (call_soon), so it has parsed it
        nonlocal watcher
        if running and watcher is None and when():
            watcher = loop.create_task(watch())

    async def receive_body() -> Message:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            loop.call_soon(start)
        return message

    try:
        response = await handler(Request(request.scope, receive_body))
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # ours alone (a shutdown's cancellation is passed on)
            if on_disconnect is not None:
                on_disconnect()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    else:
        if left:  # the handler swallowed our cancellation: leave none pending on the task
            task.uncancel()
        return response
    finally:
        running = False
        if watcher is not None and not watcher.done():
            watcher.cancel()


class SseResponse(Response):
    """Streams ``body`` (client event batches, encoded by gateway.protocol.sse) as ``text/event-stream`` and cancels
    it when the client disconnects.

    Starlette's StreamingResponse only notices a disconnect when a write fails (ASGI spec 2.4 servers), but
    the upstream may be silent for a long time while the model thinks; listening on ``receive`` makes the
    disconnect cancel the pump immediately, and the pump's ``finally`` closes the upstream request.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[list[ClientEvent]], *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None,
                 on_disconnect: Callable[[], Awaitable[None] | None] | None = None) -> None:
        self.body_iterator = body
        self.sent_bytes = 0  # body bytes handed to the server (the access log's response_bytes)
        self.first_body_at: float | None = None  # perf_counter() of the first body bytes (its TTFB)
        self.status_code = status_code
        self.on_disconnect = on_disconnect
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        disconnected = False
        ours = False  # the cancellation came from the watcher (not from a shutdown)
        body_done = False  # a client closing after the last frame is a normal end, not a disconnect

        async def watch() -> None:
            nonlocal disconnected, ours
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not body_done:
                        disconnected = ours = True
                        task.cancel()
                    return

        # One task reads the body and writes it: a send returns at once unless the client is slow (uvicorn's
        # flow control), and then not reading the upstream meanwhile is the backpressure wanted. Frames that
        # arrived together are already one chunk (the pump joins what one upstream read carried). The watcher
        # is a plain asyncio task that cancels this one: an anyio task group per response cost a measurable
        # share of a short stream's CPU (its backend lookup and cancel scopes).
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for batch in self.body_iterator:
                if batch:
                    data = encode_events(batch)
                    if self.first_body_at is None:
                        self.first_body_at = time.perf_counter()
                    self.sent_bytes += len(data)
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            body_done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not ours or task.uncancel() > 0:  # a shutdown's (or anyone else's) cancellation is passed on
                raise
        except OSError:
            disconnected = not body_done
        finally:
            if watcher.done():
                if not watcher.cancelled():
                    watcher.exception()  # retrieved: a failed receive ends the watch, not the stream
            else:
                watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if disconnected and self.on_disconnect is not None:
            result = self.on_disconnect()
            if result is not None:
                await result
