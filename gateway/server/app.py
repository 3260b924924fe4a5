"""The Starlette application: the composition root. It builds what the doors share (metrics, the drain, auth,
the concurrency limiter), the lifespan builds the running services (upstream client, store, background runs, the
engine), and the routes come from their own modules: ``/v1/responses`` (responses_routes, responses_http), the
WebSocket mode (websocket), the Conversations API (conversations), the ops endpoints and the proxy (ops)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.config import Settings
from gateway.engine.background import BackgroundRuns
from gateway.engine.context import ContextMeter
from gateway.engine.drain import Drain
from gateway.engine.respond import ResponsesHandler
from gateway.engine.tool_loop import LazyMcpHub, McpHub
from gateway.server.admission import Admission
from gateway.server.auth import ApiKeyAuth, GatewayAuthMiddleware
from gateway.server.conversations import ConversationsApi
from gateway.server.guard import HostOriginGuard
from gateway.server.health import Readiness
from gateway.server.keys import with_reasoning_key
from gateway.server.limits import ConcurrencyLimiter
from gateway.server.metrics import GatewayMetrics
from gateway.server.observe import Observer, ensure_logging
from gateway.server.ops import probe_routes, proxy_route, upstream_metrics_route
from gateway.server.responses_routes import response_routes
from gateway.server.services import Services, ServicesRef
from gateway.server.websocket import ResponsesSocket
from gateway.store import ResponseStore, open_store, run_sweeper
from gateway.upstream.client import UpstreamClient
from gateway.websearch.base import SearchProvider
from gateway.websearch.limits import WebSearchRateLimiter

if TYPE_CHECKING:  # a type only: httpx is upstream/'s
    import httpx

if TYPE_CHECKING:
    from gateway.server.workers import WorkerContext

log = structlog.get_logger("gateway.app")

__all__ = ["create_app"]


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
               store: ResponseStore | str | None = "from-settings", observer: Observer | None = None,
               mcp: McpHub | None = None, worker: WorkerContext | None = None,
               web_search: SearchProvider | str | None = "from-settings") -> Starlette:
    """Build the gateway. ``transport`` replaces the network to the upstream (tests, the demo);
    ``store`` overrides ``settings.store`` with an already built store (or None); ``worker``: this process is one
    of ``--workers N`` (limits and metrics shared with the others, gateway.server.workers)."""
    ensure_logging(settings.log_level)
    observer = observer or Observer()
    metrics = GatewayMetrics(multiprocess_dir=worker.metrics_dir if worker is not None else None)
    observer.listeners.append(metrics.observe)
    drain = Drain()
    drain.on_abort.append(metrics.aborted_on_shutdown.inc)
    readiness = Readiness(draining=lambda: drain.draining)
    auth = ApiKeyAuth(settings.all_api_keys(), owner_secret=settings.owner_secret)
    if settings.api_keys_file and not auth.enabled:
        # An empty or unreadable-looking key file would silently turn auth off: refuse to start instead.
        raise ValueError(f"--api-keys-file {settings.api_keys_file} contains no keys")
    if auth.enabled and not settings.owner_secret and settings.store != "none":
        log.warning("owner_secret_derived", message="GATEWAY_OWNER_SECRET is unset: stored objects are owned through "
                    "a hash keyed by the key set, so adding or removing a key hides what was stored before. Set it.")
    # One tally for every cap (requests, WebSocket connections, background runs): under --workers N, the gateway's.
    limiter = ConcurrencyLimiter(settings.max_concurrency, worker.tally if worker is not None else None)
    metrics.track_in_flight(lambda: limiter.active)
    services = ServicesRef()
    wrap = Admission(settings, auth=auth, drain=drain, limiter=limiter, observer=observer, metrics=metrics).wrap
    hub = mcp if mcp is not None else LazyMcpHub(settings)  # a bad servers file fails here, at start-up
    # Web search (gateway.websearch): --web-search-provider, or a provider the caller built (tests, the demo).
    # A provider missing its URL or key fails here, at start-up.
    searcher: SearchProvider | None = _provider(settings) if web_search == "from-settings" \
        else web_search  # type: ignore[assignment]
    search_rate = WebSearchRateLimiter.from_settings(settings) if searcher is not None else None

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
                                  per_owner=settings.background_per_key() if auth.enabled else 0,
                                  tally=limiter.tally)
            await runs.start()
        # The key that seals reasoning and signs approval ids: the same in every worker and replica (keys.py).
        keyed = await with_reasoning_key(settings, st)
        services.current = Services(upstream=upstream, store=st, background=runs,
                                    responses=ResponsesHandler(settings=keyed, upstream=upstream, store=st,
                                                               drain=drain, mcp=hub, background=runs,
                                                               meter=ContextMeter(upstream),
                                                               web_search=searcher,
                                                               web_search_rate=search_rate))
        app.state.services = services.current
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
            if searcher is not None:
                await searcher.aclose()
            if st is not None:
                await st.close()

    socket = ResponsesSocket(lambda: services().responses, settings=settings, observer=observer, metrics=metrics,
                             drain=drain, auth_enabled=auth.enabled, limiter=limiter)

    async def websocket_responses(ws: WebSocket) -> None:  # a function: starlette treats objects as ASGI apps
        await socket(ws)

    routes: list[BaseRoute] = [
        *probe_routes(services, drain=drain, readiness=readiness, metrics=metrics),
        upstream_metrics_route(services, wrap),
        *response_routes(services, wrap),
        WebSocketRoute("/v1/responses", websocket_responses),
        *ConversationsApi(store=lambda: services().require_store(), max_body_bytes=settings.max_body_bytes,
                          max_history_bytes=settings.max_history_bytes).routes(wrap),
        proxy_route(services, wrap, settings),  # last: every other path
    ]
    # With gateway keys and no upstream key, the client's Authorization is the gateway key: never forward it.
    middleware = [Middleware(GatewayAuthMiddleware, auth=auth,
                             strip=not settings.upstream_api_key)] if auth.enabled else []
    # Outermost: a request for a foreign Host or from a foreign Origin reaches nothing else (WebSocket included).
    guard = Middleware(HostOriginGuard, allowed_hosts=settings.effective_allowed_hosts(),
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


def _provider(settings: Settings) -> SearchProvider | None:
    """The configured web search provider; its module (an HTTP stack, the MCP address rules) is imported only when
    one is configured, so a gateway without web search does not carry it in memory."""
    if settings.web_search_provider is None:
        return None
    from gateway.websearch.providers import build_provider

    return build_provider(settings)
