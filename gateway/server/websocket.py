"""WebSocket mode on ``/v1/responses`` (OpenAI's Responses WebSocket, Codex's ``supports_websockets``).

One connection per session. Each ``{"type": "response.create", …request body…}`` message is one response; its
streaming events go back as text frames holding each event's JSON (what SSE carries in ``data:``), in order,
ending with the terminal event. Messages run one at a time, in order (later ones wait in a bounded queue).
Everything the HTTP path does applies — the frames come from the same producer (``ResponsesHandler.respond``) —
including ``--max-concurrency``: a response takes a slot for its life (none free: an error frame with status 429).
``--max-websocket-connections`` bounds the open connections (beyond it the handshake is answered 503).

Connection state: recent responses, so ``previous_response_id`` works with ``store: false`` (bounded in
responses and bytes, gone with the connection). Errors are ``{"type": "error", "status", "error": {…}}`` frames
and the connection stays open; a message over ``--max-body-bytes`` closes it with 1009. The client closing
mid-response closes the upstream request at once (the response task is cancelled). Idle connections are closed
after ``--websocket-idle-timeout`` (uvicorn pings them meanwhile). On SIGTERM the response in flight gets the
drain period (the producer ends it with ``response.failed`` after it), then the socket closes with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from starlette.websockets import WebSocket

from gateway.engine.outcome import Answered, Turn
from gateway.engine.record import RequestRecord
from gateway.engine.respond import ResponsesHandler
from gateway.errors import GatewayError, InvalidRequest, RateLimited, ServiceUnavailable
from gateway.protocol.events import ClientEvent
from gateway.protocol.request import parse_request_body
from gateway.server.auth import request_owner, unauthorized, verdict
from gateway.server.http import OrjsonResponse
from gateway.server.limits import WEBSOCKETS, ConcurrencyLimiter, Slot

log = structlog.get_logger("gateway.websocket")

__all__ = ["ConnectionCache", "ResponsesSocket"]

MAX_QUEUED = 8  # response.create messages waiting behind the running one
CACHE_RESPONSES = 32
CACHE_BYTES = 32 * 1024 * 1024
CLOSE_TOO_BIG = 1009
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN_LATER = 1013
# Client message types this endpoint knows (the websocket_messages label takes these, or "other").
MESSAGE_TYPES = frozenset({"response.create"})


class ConnectionCache:
    """A connection's recent responses: id -> the full conversation up to and including that response (history,
    input, output), oldest evicted first past ``max_responses`` or ``max_bytes``."""

    def __init__(self, max_responses: int = CACHE_RESPONSES, max_bytes: int = CACHE_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self._bytes = 0

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        found = self._items.get(response_id)
        return list(found[0]) if found is not None else None

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        size = len(orjson.dumps(conversation))
        if size > self.max_bytes:
            return  # too big to keep: a later turn needs the store (or the full history) for it
        old = self._items.pop(response_id, None)
        if old is not None:
            self._bytes -= old[1]
        self._items[response_id] = (conversation, size)
        self._bytes += size
        while self._items and (len(self._items) > self.max_responses or self._bytes > self.max_bytes):
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def _error_frame(status: int, error: dict[str, Any], stream_id: str | None = None) -> str:
    err = {"type": error.get("type") or ("server_error" if status >= 500 else "invalid_request_error"),
           "code": error.get("code"), "message": error.get("message") or "", "param": error.get("param")}
    frame: dict[str, Any] = {"type": "error", "status": status, "error": err}
    if stream_id is not None:
        frame["stream_id"] = stream_id
    return orjson.dumps(frame).decode()


def _with_lane(data: bytes, lane: bytes | None) -> bytes:
    """The event with the ``stream_id`` its ``response.create`` gave (OpenAI's WebSocket lane), spliced in
    rather than re-serialized: every event is a JSON object."""
    return data if lane is None else data[:-1] + b',"stream_id":' + lane + b"}"


def _ws_error(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    body = exc.body()["error"]
    if exc.status == 404 and exc.param == "previous_response_id":
        # OpenAI's WebSocket answer for an id it holds nowhere (store, nor this connection).
        return 400, {**body, "code": "previous_response_not_found", "type": "invalid_request_error"}
    return exc.status, body


class ResponsesSocket:
    """The ``/v1/responses`` WebSocket endpoint (one instance per app)."""

    def __init__(self, handler: Callable[[], ResponsesHandler], *, settings: Any, observer: Any, metrics: Any,
                 drain: Any, auth_enabled: bool, limiter: ConcurrencyLimiter | None = None) -> None:
        self.handler = handler
        self.settings = settings
        self.observer = observer
        self.metrics = metrics
        self.drain = drain
        self.auth_enabled = auth_enabled
        # The HTTP path's --max-concurrency slots: a response.create takes one for the response's life.
        self.limiter = limiter or ConcurrencyLimiter(settings.max_concurrency)
        # Connections accepted (or being accepted) and not yet closed, counted with the limiter's tally: under
        # --workers N the cap is the gateway's.
        self.tally = self.limiter.tally

    @property
    def open(self) -> int:
        return self.tally.total(WEBSOCKETS)

    async def __call__(self, ws: WebSocket) -> None:
        if self.auth_enabled:
            authorized, presented = verdict(ws.scope)
            if not authorized:  # 401 before upgrading, in OpenAI's shape
                self.metrics.reject("unauthorized")
                exc: GatewayError = unauthorized(presented)
                with contextlib.suppress(RuntimeError):
                    await ws.send_denial_response(OrjsonResponse(exc.body(), status_code=401, headers=exc.headers))
                    return
                await ws.close(code=1008)
                return
        if self.drain.draining:
            await ws.close(code=CLOSE_GOING_AWAY)
            return
        cap = self.settings.max_websocket_connections
        # Counted before the first await, so concurrent handshakes cannot overshoot the cap.
        if self.tally.take(WEBSOCKETS, cap if cap > 0 else None) is not None:
            # 503 before upgrading: an open socket costs memory and a task set
            self.metrics.reject("websocket_connections")
            exc = ServiceUnavailable(f"The gateway holds its maximum of {cap} WebSocket connections; retry "
                                     "shortly or use HTTP.", code="too_many_websocket_connections",
                                     headers={"retry-after": "1"})
            with contextlib.suppress(RuntimeError):
                await ws.send_denial_response(OrjsonResponse(exc.body(), status_code=503, headers=exc.headers))
                return
            await ws.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        try:
            await ws.accept()
            self.metrics.websocket_connections.inc()
            try:
                await _Connection(self, ws).run()
            finally:
                self.metrics.websocket_connections.dec()
        finally:
            self.tally.give(WEBSOCKETS)


class _Connection:
    def __init__(self, endpoint: ResponsesSocket, ws: WebSocket) -> None:
        self.endpoint = endpoint
        self.ws = ws
        self.settings = endpoint.settings
        self.cache = ConnectionCache()
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(MAX_QUEUED)
        self.owner = request_owner(ws.scope)
        self.headers = {k: v for k, v in ws.headers.items() if k.lower() not in ("sec-websocket-key",)}
        self.closed = False
        self.current: asyncio.Task[None] | None = None
        self.close_code: int | None = None
        self.last_active = time.monotonic()  # the last message received or response finished (idle timeout)

    async def run(self) -> None:
        worker = asyncio.create_task(self._work())
        reader = asyncio.create_task(self._read())
        watcher = asyncio.create_task(self._watch())
        try:
            await asyncio.wait({worker, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.closed = True
            for task in (reader, watcher):
                task.cancel()
            if self.current is not None and not self.current.done():
                self.current.cancel()  # the client left mid-response: its upstream request is closed now
            worker.cancel()
            for task in (worker, reader, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.close_code is not None:
                with contextlib.suppress(Exception):
                    await self.ws.close(code=self.close_code)

    def _idle_left(self) -> float | None:
        """Seconds until this connection counts as idle (None: never). While a response runs or waits, a full
        period: the reader checks again then. Idle means quiet since the last message *and* the last response."""
        idle = self.settings.websocket_idle_timeout
        if idle <= 0:
            return None
        if (self.current is not None and not self.current.done()) or not self.queue.empty():
            return idle
        return max(0.0, self.last_active + idle - time.monotonic())

    async def _read(self) -> None:
        limit = self.settings.max_body_bytes
        while True:
            try:
                async with asyncio.timeout(self._idle_left()):
                    message = await self.ws.receive()
            except TimeoutError:
                if self._idle_left() == 0:
                    self.close_code = 1000  # idle: nothing asked for, nothing running, for that long
                    return
                continue  # a response ran meanwhile: the clock starts from its end
            self.last_active = time.monotonic()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None and message.get("bytes") is not None:
                text = message["bytes"].decode("utf-8", "replace")
            if text is None:
                continue
            # the limit is in bytes, as for an HTTP body (a character may be up to 4 of them)
            if len(text) > limit or (not text.isascii() and len(text.encode()) > limit):
                self.close_code = CLOSE_TOO_BIG
                return
            try:
                self.queue.put_nowait(text)
            except asyncio.QueueFull:
                await self._send(_error_frame(429, {"code": "too_many_queued_requests", "type": "rate_limit_error",
                                                    "message": f"At most {MAX_QUEUED} response.create messages may "
                                                               "wait on one connection."}))

    async def _watch(self) -> None:
        """SIGTERM: once the running response (if any) is over, close with 1001."""
        while not self.endpoint.drain.draining:
            await asyncio.sleep(0.2)
        while self.current is not None and not self.current.done():
            await asyncio.sleep(0.05)
        self.close_code = CLOSE_GOING_AWAY
        self.closed = True
        with contextlib.suppress(Exception):
            await self.ws.close(code=CLOSE_GOING_AWAY)

    async def _work(self) -> None:
        while True:
            text = await self.queue.get()
            if text is None or self.closed:
                return
            self.current = asyncio.create_task(self._message(text))
            try:
                await asyncio.shield(self.current)
            except asyncio.CancelledError:
                self.current.cancel()
                raise
            finally:
                self.last_active = time.monotonic()

    async def _send(self, text: str) -> None:
        if not self.closed:
            await self.ws.send_text(text)

    async def _message(self, text: str) -> None:
        try:
            message = orjson.loads(text)
        except orjson.JSONDecodeError:
            await self._send(_error_frame(400, {"code": "invalid_json", "message": "The message is not valid JSON."}))
            return
        mtype = message.get("type") if isinstance(message, dict) else None
        # A label value per known type only: client-chosen strings would mint a series each on /metrics.
        label = "invalid" if not isinstance(mtype, str) else mtype if mtype in MESSAGE_TYPES else "other"
        self.endpoint.metrics.websocket_messages.labels(label).inc()
        if mtype != "response.create":
            await self._send(_error_frame(400, {"code": "unknown_message_type", "param": "type",
                                                "message": f"Unsupported message type {mtype!r}: this endpoint "
                                                           "accepts 'response.create'."}))
            return
        await self._create(message, len(text) if text.isascii() else len(text.encode()))

    async def _create(self, message: dict[str, Any], size: int) -> None:
        record = RequestRecord(request_id="req_" + uuid.uuid4().hex, route="/v1/responses", method="WEBSOCKET",
                               started=time.perf_counter())
        record.request_bytes = size
        self.endpoint.observer.begin(record)
        slot: Slot | None = None
        try:
            try:
                slot = self.endpoint.limiter.acquire()
            except RateLimited as exc:  # the HTTP path's 429, as a frame; the connection stays open
                self.endpoint.metrics.reject("concurrency")
                sid = message.get("stream_id") if isinstance(message.get("stream_id"), str) else None
                record.status, record.error_code = exc.status, exc.code
                await self._send(_error_frame(exc.status, exc.body()["error"], sid))
                return
            await self._respond(message, record)
        finally:
            if slot is not None:
                slot.release()
            record.duration = time.perf_counter() - record.started
            self.endpoint.observer.end(record)

    async def _respond(self, message: dict[str, Any], record: RequestRecord) -> None:
        sid = message.get("stream_id") if isinstance(message.get("stream_id"), str) else None
        lane = orjson.dumps(sid) if sid is not None else None
        body = {k: v for k, v in message.items() if k not in ("type", "stream_id")}
        body["stream"] = True  # every response streams here (Codex sends stream: true anyway)
        try:
            # The same envelope checks (types, nesting) as an HTTP body.
            body = parse_request_body(orjson.dumps(body))
            if body.get("background"):
                raise InvalidRequest("background is not supported over the WebSocket; use POST /v1/responses.",
                                     param="background", code="unsupported_parameter")
            turn = Turn(local_history=self.cache.get)
            outcome = await self.endpoint.handler().respond(body, self.headers, self.owner, record, turn)
        except GatewayError as exc:
            record.status, error = _ws_error(exc)
            record.error_code = error.get("code")
            await self._send(_error_frame(record.status, error, sid))
            return
        except Exception as exc:  # never a dropped connection for one bad request: the HTTP path's 500, as a frame
            log.error("unhandled_error", request_id=record.request_id, route="/v1/responses (websocket)",
                      error=type(exc).__name__)
            record.status, record.error_code = 500, "internal_error"
            await self._send(_error_frame(500, {"type": "server_error", "code": "internal_error",
                                                "message": "The gateway failed to handle this request."}, sid))
            return
        if isinstance(outcome, Answered):
            payload = outcome.payload if isinstance(outcome.payload, dict) else {}
            record.status = outcome.status
            await self._send(_error_frame(outcome.status, payload.get("error") or {}, sid))
            return
        record.status = 200
        final: dict[str, Any] | None = None
        frames = outcome.events
        try:
            async for batch in frames:
                if record.ttfb is None and batch:
                    record.ttfb = time.perf_counter() - record.started
                for event in batch:
                    data = ws_text(event, lane)
                    await self._send(data)
                    record.response_bytes += len(event.data)
                    if event.terminal:
                        final = _terminal(event) or final
        except asyncio.CancelledError:
            record.disconnected = True
            raise
        finally:
            await frames.aclose()  # type: ignore[attr-defined]
        if final is not None:
            self.cache.put(final["id"], [*turn.history, *turn.input_items,
                                         *(i for i in final.get("output") or () if isinstance(i, dict))])


def ws_text(event: ClientEvent, lane: bytes | None) -> str:
    """A client event as a WebSocket text frame (the WebSocket mode's one encoder): its JSON, with the request's
    ``stream_id`` when it has one."""
    return _with_lane(event.data, lane).decode()


def _terminal(event: ClientEvent) -> dict[str, Any] | None:
    response = event.payload.get("response")
    return response if isinstance(response, dict) and isinstance(response.get("id"), str) else None
