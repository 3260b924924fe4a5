"""Every gateway request's bookkeeping around its handler: its record (request id, log line, metrics), the
checks it passes before the handler runs (keys, the drain, the body bounded in bytes and time, a concurrency
slot), its errors in OpenAI's shape, and the slot released once the answer was sent, whatever happened."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.config import Settings
from gateway.engine.background import BackgroundPerKeyLimit
from gateway.engine.drain import Drain
from gateway.engine.record import RequestRecord
from gateway.errors import GatewayError, PayloadTooLarge, RateLimited, ServiceUnavailable, Unauthorized
from gateway.server.auth import ApiKeyAuth, unauthorized, verdict
from gateway.server.http import CLIENT_CLOSED_REQUEST, BodyTimeout, ClientLeft, SseResponse, buffer_body, error_response
from gateway.server.limits import ConcurrencyLimiter, Slot
from gateway.server.metrics import GatewayMetrics
from gateway.server.observe import Observer

log = structlog.get_logger("gateway.app")

__all__ = ["Admission", "Endpoint", "Handler"]

Handler = Callable[[Request, RequestRecord], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


class Admission:
    """``wrap(route, handler)``: the endpoint that runs ``handler`` inside the bookkeeping above."""

    def __init__(self, settings: Settings, *, auth: ApiKeyAuth, drain: Drain, limiter: ConcurrencyLimiter,
                 observer: Observer, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.auth = auth
        self.drain = drain
        self.limiter = limiter
        self.observer = observer
        self.metrics = metrics

    async def admit(self, request: Request) -> tuple[Request, Slot]:
        """Checks every gateway request passes before its handler runs, cheapest and most telling first; the
        request returned has its body read (bounded in bytes and time) before the concurrency slot is taken."""
        if self.auth.enabled:
            authorized, presented = verdict(request.scope)
            if not authorized:
                raise unauthorized(presented)
        if self.drain.draining:
            raise ServiceUnavailable("The gateway is shutting down; retry on another instance.",
                                     code="gateway_shutting_down", headers={"connection": "close"})
        request = await buffer_body(request, self.settings.max_body_bytes, self.settings.body_read_timeout)
        return request, self.limiter.acquire()

    def wrap(self, route: str, handler: Handler) -> Endpoint:
        observer, metrics, settings = self.observer, self.metrics, self.settings

        async def endpoint(request: Request) -> Response:
            record = RequestRecord(request_id=_request_id(request), route=route, method=request.method,
                                   started=time.perf_counter())
            observer.begin(record)
            slot: Slot | None = None
            try:
                request, slot = await self.admit(request)
                response = await handler(request, record)
            except GatewayError as exc:
                record.error_code = exc.code
                reason = _rejection(exc)
                if reason is not None:
                    metrics.reject(reason)
                response = error_response(exc)
            except ClientLeft:  # gone before its body was complete: nothing to answer, a 499 in the log
                record.disconnected = True
                response = Response(status_code=CLIENT_CLOSED_REQUEST)
            except Exception as exc:  # never a traceback to the client; the log has the type, not the payload
                log.error("unhandled_error", request_id=record.request_id, route=route, error=type(exc).__name__,
                          exc_info=settings.log_level == "debug")
                record.error_code = "internal_error"
                response = error_response(GatewayError("The gateway failed to handle this request.", status=500,
                                                       type="server_error", code="internal_error"))
            response.headers["x-request-id"] = record.request_id
            record.status = response.status_code
            streaming = isinstance(response, SseResponse | StreamingResponse)
            if streaming and record.stream:
                metrics.active_streams.inc()

            def done() -> None:
                if slot is not None:
                    slot.release()
                if streaming and record.stream:
                    metrics.active_streams.dec()
                record.duration = time.perf_counter() - record.started
                observer.end(record)

            return _Tracked(response, record, done)

        return endpoint


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= 128 and given.isprintable():
        return given
    return "req_" + uuid.uuid4().hex


class _Tracked(Response):
    """Runs ``done`` after the wrapped response was sent, whatever happened while sending it.

    A finally around the body iterator is not enough: a generator that never started (client gone before
    the first byte) never runs its finally, and the concurrency slot would leak.
    """

    def __init__(self, inner: Response, record: RequestRecord, done: Callable[[], None]) -> None:
        self.inner = inner
        self.record = record
        self.done = done
        self.status_code = inner.status_code
        self.background = None
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = self.record
        inner = self.inner
        if isinstance(inner, SseResponse):  # counts its own bytes: no wrapper around every frame's send
            try:
                await inner(scope, receive, send)
            finally:
                record.response_bytes += inner.sent_bytes
                if record.ttfb is None and inner.first_body_at is not None:
                    record.ttfb = inner.first_body_at - record.started
                self.done()
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.body":
                size = len(message.get("body", b""))
                if size and record.ttfb is None:
                    record.ttfb = time.perf_counter() - record.started
                record.response_bytes += size
            await send(message)

        try:
            await self.inner(scope, receive, counting_send)
        finally:
            self.done()


def _rejection(exc: GatewayError) -> str | None:
    if isinstance(exc, Unauthorized):
        return "unauthorized"
    if isinstance(exc, BackgroundPerKeyLimit):
        return "background_per_key"
    if isinstance(exc, RateLimited):
        return "concurrency"
    if isinstance(exc, PayloadTooLarge):
        return "body_too_large"
    if isinstance(exc, BodyTimeout):
        return "body_timeout"
    if isinstance(exc, ServiceUnavailable) and exc.code == "gateway_shutting_down":
        return "draining"
    return None
