"""The upstream HTTP/1.1 transport for httpx: httptools' C parser on a bare asyncio protocol.

Why not httpx's own transport or httpx-aiohttp's: every response the gateway streams makes one or two
model requests, and each upstream frame is one socket read. httpcore over pure-Python h11 cost several
times more per frame; aiohttp through httpx-aiohttp, measured against the bench's fake upstream on this
stack, cost ~440 µs of CPU per request before its first body byte (``ClientSession._request``: timers,
tracing hooks, multidicts, yarl URLs, the happy-eyeballs connect) against ~300 µs here, and ~2× more per
body read (a ``StreamReader`` per response, a timer rescheduled per chunk) — plus ~10 MB of imports in
every process. This module is that bare protocol, kept small: HTTP/1.1 only, ``httptools`` (already
uvicorn's parser), one pool of keep-alive connections per origin, and httpx's own ``Request``/``Response``
objects and exceptions, so callers see httpx.

What it does: connect (``loop.create_connection``, TLS with SNI for https), pool and reuse connections up
to ``httpx.Limits`` (a request past ``max_connections`` waits up to the pool timeout), drop idle ones after
``keepalive_expiry``, retry once on a fresh connection when a reused one turns out closed before any answer
byte (the server timed it out), write the request in one write, hand over everything the socket has
buffered in one read, pause reading past a bound when the reader falls behind, and time out reads with one
timer per connection that is re-armed only when it fires (not per chunk). Closing a response whose body is
complete returns its connection to the pool; closing it earlier drops the connection, which aborts the
upstream request (vLLM stops generating). Request bodies are bytes: the gateway's are JSON it built, and the
pass-through proxy reads a client's body (bounded by ``--max-body-bytes``) before forwarding it.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx

__all__ = ["DIRECT_BODY", "H1Transport"]

DIRECT_BODY = "gateway.direct_body"  # response extension: the body stream, for readers that skip httpx's decoders

# Reading pauses while this much body is buffered unread (the client is slower than the upstream).
HIGH_WATER = 1 << 17


class _Conn(asyncio.Protocol):
    """One upstream connection: the protocol callbacks fill the current response's state."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers_done = False
        self.head_only = False
        self.keep_alive = False
        self.complete = False
        self.error: Exception | None = None
        self.received = False  # any answer byte for the current request
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.last_data = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.read_timeout: float | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop's transports are not asyncio.Transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("The upstream switched protocols."))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"The upstream sent invalid HTTP ({type(exc).__name__})."))
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self.headers_done and not self._framed():  # a body delimited by the connection's end
                self.complete = True
            else:
                self.error = httpx.RemoteProtocolError(
                    "The upstream closed the connection before the answer was complete."
                    if self.received else "The upstream closed the connection without an answer.")
        self._cancel_timer()
        self._wake()

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful while the message is being parsed
        self.headers_done = True
        if self.head_only:  # no body, whatever content-length says; httptools cannot be told: not reused
            self.keep_alive = False
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- helpers

    def _framed(self) -> bool:
        for name, value in self.headers:
            n = name.lower()
            if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        self.timer = None
        timeout = self.read_timeout
        if timeout is None or self.complete or self.error is not None or self.waiter is None:
            return
        idle = self.loop.time() - self.last_data
        if idle >= timeout:
            self._fail(httpx.ReadTimeout(f"No upstream bytes for {timeout:g} s."))
            self._wake()
        else:
            self.timer = self.loop.call_at(self.last_data + timeout, self._on_timer)

    async def wait(self) -> None:
        """Until the parser has more for the reader (or the message ended, or failed)."""
        self.waiter = self.loop.create_future()
        if self.timer is None and self.read_timeout is not None:
            self.timer = self.loop.call_at(self.last_data + self.read_timeout, self._on_timer)
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return (self.complete and self.error is None and not self.closed and self.transport is not None
                and not self.transport.is_closing() and self.keep_alive)

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class _Body(httpx.AsyncByteStream):
    """The answer's body: each read is everything buffered so far. ``aclose`` pools or drops the connection."""

    def __init__(self, conn: _Conn, done: Any) -> None:
        self._conn = conn
        self._done = done  # (conn, reusable) -> None, once

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return
            await conn.wait()

    async def aclose(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(self._conn, self._conn.reusable() and not self._conn.chunks)


class H1Transport(httpx.AsyncBaseTransport):
    def __init__(self, *, limits: httpx.Limits, ssl_context: ssl.SSLContext | None = None) -> None:
        self._max = limits.max_connections
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], collections.deque[_Conn]] = {}
        self._active = 0
        self._slots: collections.deque[asyncio.Future[None]] = collections.deque()
        self.connections_opened = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        try:
            content = request.content
        except httpx.RequestNotRead:
            raise NotImplementedError("H1Transport sends bytes bodies only; read the body first.") from None
        head_only = request.method == "HEAD"
        await self._acquire(timeout.get("pool"))
        key = (request.url.scheme, request.url.host, request.url.port or (443 if request.url.scheme == "https"
                                                                          else 80))
        head = _head(request, content)
        conn: _Conn | None = None
        try:
            for attempt in (0, 1):
                conn = self._pooled(key) if attempt == 0 else None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(key, timeout.get("connect"))
                conn.read_timeout = timeout.get("read")
                conn.last_data = conn.loop.time()
                assert conn.transport is not None
                conn.transport.write(head)
                conn.head_only = head_only
                while not conn.headers_done and conn.error is None:
                    await conn.wait()
                if conn.headers_done:
                    break
                conn.close()
                if not (reused and not conn.received):  # a stale pooled connection is retried once, fresh
                    raise conn.error  # type: ignore[misc]
            else:  # pragma: no cover (the loop breaks or raises)
                raise httpx.RemoteProtocolError("The upstream closed the connection without an answer.")
        except BaseException:  # a failure, or a cancellation (the client left): the request is abandoned
            if conn is not None:
                conn.close()
            self._release_slot()
            raise
        body = _Body(conn, self._finished)
        return httpx.Response(conn.status, headers=conn.headers, stream=body,
                              extensions={"http_version": b"HTTP/1.1", DIRECT_BODY: body})

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # -- pool

    async def _acquire(self, pool_timeout: float | None) -> None:
        if self._max is None or self._active < self._max:
            self._active += 1
            return
        slot = asyncio.get_running_loop().create_future()
        self._slots.append(slot)
        try:
            async with asyncio.timeout(pool_timeout):
                await slot
        except BaseException as exc:  # timed out or cancelled
            if slot.done() and not slot.cancelled():
                self._release_slot()  # granted at the moment we gave up: pass it on
            else:
                slot.cancel()
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout("No upstream connection became free in time.") from None
            raise

    def _release_slot(self) -> None:
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot moves to the waiter; _active is unchanged
                return
        self._active -= 1

    def _finished(self, conn: _Conn, reusable: bool) -> None:
        conn._cancel_timer()
        if reusable and (self._max_idle is None or sum(map(len, self._idle.values())) < self._max_idle):
            conn._reset()
            conn.idle_since = conn.loop.time()
            key = conn.key  # type: ignore[attr-defined]
            self._idle.setdefault(key, collections.deque()).append(conn)
        else:
            conn.close()
        self._release_slot()

    def _pooled(self, key: tuple[str, str, int]) -> _Conn | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()  # the most recently used: the least likely to have been timed out
            expired = self._expiry is not None and conn.loop.time() - conn.idle_since > self._expiry
            if conn.closed or expired or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, key: tuple[str, str, int], connect_timeout: float | None) -> _Conn:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()  # certifi's bundle, as httpx's own transport
            tls = self._ssl
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(loop), host, port, ssl=tls,
                                                       server_hostname=host if tls is not None else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"Connecting to the upstream took over {connect_timeout:g} s.") from None
        except OSError as exc:
            raise httpx.ConnectError(f"The upstream refused or is unreachable ({type(exc).__name__}).") from exc
        conn.key = key  # type: ignore[attr-defined]
        self.connections_opened += 1
        return conn


def _head(request: httpx.Request, content: bytes) -> bytes:
    """Request line, headers and body as one write (httpx has set host and content-length)."""
    target = request.url.raw_path
    lines = [request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    lines.append(content)
    return b"".join(lines)
