"""The Starlette application: routes, lifespan (upstream client, store), request bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway.config import Settings
from gateway.engine.background import BackgroundPerKeyLimit, BackgroundRuns
from gateway.engine.drain import Drain
from gateway.engine.record import RequestRecord
from gateway.engine.respond import ResponsesHandler
from gateway.engine.tool_loop import LazyMcpHub, McpHub
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
)
from gateway.server.auth import ApiKeyAuth, GatewayAuthMiddleware, request_owner, unauthorized, verdict
from gateway.server.conversations import ConversationsApi
from gateway.server.guard import HostOriginGuard
from gateway.server.health import Readiness, UpstreamMetrics
from gateway.server.http import (
    CLIENT_CLOSED_REQUEST,
    BodyTimeout,
    ClientLeft,
    OrjsonResponse,
    SseResponse,
    buffer_body,
    cancel_on_disconnect,
    error_response,
    list_query,
)
from gateway.server.limits import ConcurrencyLimiter, Slot, limited_stream
from gateway.server.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from gateway.server.observe import Observer, ensure_logging
from gateway.server.responses_http import create_response as create_http_response
from gateway.server.websocket import ResponsesSocket
from gateway.store import ResponseStore, open_store, run_sweeper
from gateway.upstream.client import PROXY_DROP_RESPONSE, UpstreamClient

log = structlog.get_logger("gateway.app")

__all__ = ["create_app"]

Handler = Callable[[Request, RequestRecord], Awaitable[Response]]


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


def _left(record: RequestRecord) -> None:
    record.disconnected = True


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


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
               store: ResponseStore | str | None = "from-settings", observer: Observer | None = None,
               mcp: McpHub | None = None) -> Starlette:
    """Build the gateway. ``transport`` replaces the network to the upstream (tests, the demo);
    ``store`` overrides ``settings.store`` with an already built store (or None)."""
    ensure_logging(settings.log_level)
    observer = observer or Observer()
    metrics = GatewayMetrics()
    observer.listeners.append(metrics.observe)
    drain = Drain()
    drain.on_abort.append(metrics.aborted_on_shutdown.inc)
    readiness = Readiness(draining=lambda: drain.draining)
    vllm_metrics = UpstreamMetrics()
    auth = ApiKeyAuth(settings.all_api_keys(), owner_secret=settings.owner_secret)
    if settings.api_keys_file and not auth.enabled:
        # An empty or unreadable-looking key file would silently turn auth off: refuse to start instead.
        raise ValueError(f"--api-keys-file {settings.api_keys_file} contains no keys")
    if auth.enabled and not settings.owner_secret and settings.store != "none":
        log.warning("owner_secret_derived", message="GATEWAY_OWNER_SECRET is unset: stored objects are owned through "
                    "a hash keyed by the key set, so adding or removing a key hides what was stored before. Set it.")
    limiter = ConcurrencyLimiter(settings.max_concurrency)
    metrics.in_flight.set_function(lambda: limiter.active)
    services: dict[str, Any] = {}

    async def admit(request: Request) -> tuple[Request, Slot]:
        """Checks every gateway request passes before its handler runs, cheapest and most telling first; the
        request returned has its body read (bounded in bytes and time) before the concurrency slot is taken."""
        if auth.enabled:
            authorized, presented = verdict(request.scope)
            if not authorized:
                raise unauthorized(presented)
        if drain.draining:
            raise ServiceUnavailable("The gateway is shutting down; retry on another instance.",
                                     code="gateway_shutting_down", headers={"connection": "close"})
        request = await buffer_body(request, settings.max_body_bytes, settings.body_read_timeout)
        return request, limiter.acquire()

    def wrap(route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            record = RequestRecord(request_id=_request_id(request), route=route, method=request.method,
                                   started=time.perf_counter())
            observer.begin(record)
            slot: Slot | None = None
            try:
                request, slot = await admit(request)
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

    async def create_response(request: Request, record: RequestRecord) -> Response:
        handler: ResponsesHandler = services["responses"]
        # A non-streamed answer is cancelled (its upstream request closed) if the client leaves while it waits;
        # a streamed one watches the connection itself (SseResponse).
        return await cancel_on_disconnect(request, lambda req: create_http_response(handler, req, record),
                                          when=lambda: not record.stream, on_disconnect=lambda: _left(record))

    def _store() -> ResponseStore:
        st = services.get("store")
        if st is None:
            raise NotFound("Stored responses are disabled on this gateway (--store none).", code="store_disabled")
        return st

    async def get_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        owner = request_owner(request.scope)
        stream = request.query_params.get("stream", "").lower() == "true"
        after = _starting_after(request.query_params.get("starting_after")) if stream else -1
        rec = await _store().get(rid, owner=owner)
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        if not stream:
            return OrjsonResponse(rec.response)
        runs: BackgroundRuns | None = services.get("background")
        if runs is None or rec.response.get("background") is not True:
            raise InvalidRequest("Only responses created with background=true can be streamed.", param="stream",
                                 code="unsupported_parameter")
        # Its stored events after starting_after, then the live ones until the terminal event, from any replica.
        record.stream = True
        return SseResponse(runs.follow(rid, after, owner), on_disconnect=lambda: _left(record))

    async def delete_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        if not await _store().delete(rid, owner=request_owner(request.scope)):
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        return OrjsonResponse({"id": rid, "object": "response", "deleted": True})

    async def cancel_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        owner = request_owner(request.scope)
        store = _store()
        runs: BackgroundRuns | None = services.get("background")
        # A background response still running is cancelled on whichever replica runs it; idempotent.
        rec = await runs.cancel(rid, owner) if runs is not None else await store.get(rid, owner=owner)
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        if rec.response.get("background") is not True:
            raise InvalidRequest("Only responses created with background=true can be cancelled.",
                                 param="response_id", code="invalid_request")
        return OrjsonResponse(rec.response)

    async def list_input_items(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        rec = await _store().get(rid, owner=request_owner(request.scope))
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        return OrjsonResponse(paginate(rec.input_items, request.query_params))

    async def proxy(request: Request, record: RequestRecord) -> Response:
        upstream: UpstreamClient = services["upstream"]
        # Only vLLM's public inference endpoints (--proxy-paths): its admin and development ones (/sleep,
        # /collective_rpc, ...) would run with the upstream key on any key holder's request.
        path = upstream.proxy_path(request.scope.get("raw_path") or request.url.path.encode())
        if path is None:
            raise NotFound(f"Invalid URL ({request.method} {request.url.path}).", code="unknown_url")
        body = None
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            limit = settings.max_body_bytes
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise PayloadTooLarge(f"The request body is {declared} bytes; the limit is {limit} bytes.")
            body = limited_stream(request.stream(), limit)
        up = await upstream.proxy(request.method, path, request.url.query, request.headers, body)
        headers = {k: v for k, v in up.response.headers.items() if k.lower() not in PROXY_DROP_RESPONSE}
        record.status = up.status_code

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                record.upstream_error = "stream_broken"
            finally:
                await up.aclose()

        return StreamingResponse(relay(), status_code=up.status_code, headers=headers)

    hub = mcp if mcp is not None else LazyMcpHub(settings)  # a bad servers file fails here, at start-up

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        upstream = UpstreamClient(settings, transport=transport)
        st: ResponseStore | None = open_store(settings.store, settings.sqlite_synchronous) \
            if store == "from-settings" else store  # type: ignore[assignment]
        sweeper = None
        runs: BackgroundRuns | None = None
        if st is not None:
            await st.start()
            if settings.store_ttl > 0:
                sweeper = asyncio.create_task(run_sweeper(st, int(settings.store_ttl),
                                                          interval=min(300.0, max(1.0, settings.store_ttl / 10))))
            # Background responses: runs, leases, and the sweep of those whose replica stopped (at start-up too).
            # Per key only under API keys: without them every client is the one owner (None).
            runs = BackgroundRuns(st, limit=settings.max_background_responses, drain=drain,
                                  drain_timeout=settings.drain_timeout,
                                  per_owner=settings.background_per_key() if auth.enabled else 0)
            await runs.start()
        services.update(upstream=upstream, store=st, background=runs,
                        responses=ResponsesHandler(settings=settings, upstream=upstream, store=st, drain=drain,
                                                   mcp=hub, background=runs))
        app.state.services = services
        try:
            yield
        finally:
            if runs is not None:  # first: runs still going use the upstream client and the store
                await runs.close()
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            await upstream.aclose()
            closer = getattr(hub, "aclose", None)
            if closer is not None:
                await closer()
            if st is not None:
                await st.close()

    # Operational endpoints: no auth, no concurrency slot, no access log line (probes poll every few seconds).
    no_store = {"cache-control": "no-store"}

    async def healthz(request: Request) -> Response:
        return OrjsonResponse({"status": "ok"}, headers=no_store)

    async def readyz(request: Request) -> Response:
        upstream: UpstreamClient = services["upstream"]
        state = await readiness.check(upstream.http, upstream.auth_headers({}))
        if not drain.draining:
            metrics.upstream_ready.set(1 if state.ready else 0)
        if state.ready:
            return OrjsonResponse({"status": "ok"}, headers=no_store)
        return OrjsonResponse({"status": "unavailable", "reason": state.reason}, status_code=503, headers=no_store)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST, headers=no_store)

    async def upstream_metrics(request: Request, record: RequestRecord) -> Response:
        upstream: UpstreamClient = services["upstream"]
        # Unlike the probes above, a request like the others (wrap: behind the gateway keys, in a slot, counted):
        # it sends the upstream key to vLLM. Cached: one upstream scrape per second at most.
        answer = await vllm_metrics.get(upstream.http, upstream.auth_headers({}))
        return Response(answer.body, status_code=answer.status, headers=no_store,
                        media_type=answer.content_type or CONTENT_TYPE_LATEST)

    socket = ResponsesSocket(lambda: services["responses"], settings=settings, observer=observer, metrics=metrics,
                             drain=drain, auth_enabled=auth.enabled, limiter=limiter)

    async def websocket_responses(ws: WebSocket) -> None:  # a function: starlette treats objects as ASGI apps
        await socket(ws)

    routes = [
        Route("/healthz", healthz, methods=["GET", "HEAD"]),
        Route("/readyz", readyz, methods=["GET", "HEAD"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/upstream/metrics", wrap("/upstream/metrics", upstream_metrics), methods=["GET"]),
        Route("/v1/responses", wrap("/v1/responses", create_response), methods=["POST"]),
        WebSocketRoute("/v1/responses", websocket_responses),
        Route("/v1/responses/{response_id}", wrap("/v1/responses/{id}", get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", wrap("/v1/responses/{id}", delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", wrap("/v1/responses/{id}/input_items", list_input_items),
              methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", wrap("/v1/responses/{id}/cancel", cancel_response),
              methods=["POST"]),
        *ConversationsApi(store=_store, max_body_bytes=settings.max_body_bytes,
                          max_history_bytes=settings.max_history_bytes).routes(wrap),
        Route("/{path:path}", wrap("proxy", proxy),
              methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
    ]
    # With gateway keys and no upstream key, the client's Authorization is the gateway key: never forward it.
    middleware = [Middleware(GatewayAuthMiddleware, auth=auth,  # type: ignore[arg-type]
                             strip=not settings.upstream_api_key)] if auth.enabled else []
    # Outermost: a request for a foreign Host or from a foreign Origin reaches nothing else (WebSocket included).
    guard = Middleware(HostOriginGuard, allowed_hosts=settings.effective_allowed_hosts(),  # type: ignore[arg-type]
                       allowed_origins=settings.allowed_origins, on_refused=metrics.reject)
    middleware.insert(0, guard)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.settings = settings
    app.state.observer = observer
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.readiness = readiness
    app.state.limiter = limiter
    return app


def paginate(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """OpenAI's list shape over stored input items: ``limit`` (1-100), ``order``, ``after``, ``before``."""
    limit, order = list_query(query)
    seq = list(items) if order == "asc" else list(reversed(items))
    ids = [i.get("id") for i in seq]
    for key in ("after", "before"):
        cursor = query.get(key)
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"No input item with id '{cursor}'.", param=key, code="invalid_value")
    if query.get("after") is not None:
        seq = seq[ids.index(query["after"]) + 1 :]
    if query.get("before") is not None:
        ids = [i.get("id") for i in seq]
        seq = seq[: ids.index(query["before"])] if query["before"] in ids else seq
        seq = seq[-limit:]
    page = seq[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(seq) > len(page),
    }


def _starting_after(raw: str | None) -> int:
    """``starting_after`` of ``GET /v1/responses/{id}?stream=true``: a sequence number (-1 or absent: from the
    first event)."""
    if raw is None or raw == "":
        return -1
    if not _INTEGER.fullmatch(raw):
        raise InvalidRequest("'starting_after' must be an integer.", param="starting_after", code="invalid_type")
    value = int(raw)
    # Sequence numbers are stored as 64-bit integers: a larger cursor would overflow the store's query.
    if not -1 <= value <= _MAX_SEQUENCE:
        raise InvalidRequest(f"'starting_after' must be between -1 and {_MAX_SEQUENCE}.", param="starting_after",
                             code="invalid_value")
    return value


_INTEGER = re.compile(r"-?[0-9]{1,20}")
_MAX_SEQUENCE = 2**63 - 1
