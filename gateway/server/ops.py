"""The operational doors: the probes and the gateway's metrics (no auth, no slot, no access log line: probes poll
every few seconds), vLLM's own metrics behind the gateway keys, and the pass-through proxy to the allow-listed
upstream paths."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.config import Settings
from gateway.engine.drain import Drain
from gateway.engine.record import RequestRecord
from gateway.errors import NotFound, PayloadTooLarge
from gateway.server.health import Readiness, UpstreamMetrics
from gateway.server.http import OrjsonResponse
from gateway.server.limits import limited_stream
from gateway.server.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from gateway.server.responses_routes import Wrap
from gateway.server.services import Services
from gateway.upstream.client import PROXY_DROP_RESPONSE

__all__ = ["probe_routes", "proxy_route", "upstream_metrics_route"]

_NO_STORE = {"cache-control": "no-store"}


def probe_routes(services: Callable[[], Services], *, drain: Drain, readiness: Readiness,
                 metrics: GatewayMetrics) -> list[Route]:
    async def healthz(request: Request) -> Response:
        return OrjsonResponse({"status": "ok"}, headers=_NO_STORE)

    async def readyz(request: Request) -> Response:
        state = await readiness.check(services().upstream)
        if not drain.draining:
            metrics.upstream_ready.set(1 if state.ready else 0)
        if state.ready:
            return OrjsonResponse({"status": "ok"}, headers=_NO_STORE)
        return OrjsonResponse({"status": "unavailable", "reason": state.reason}, status_code=503, headers=_NO_STORE)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST, headers=_NO_STORE)

    return [
        Route("/healthz", healthz, methods=["GET", "HEAD"]),
        Route("/readyz", readyz, methods=["GET", "HEAD"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]


def upstream_metrics_route(services: Callable[[], Services], wrap: Wrap) -> Route:
    vllm_metrics = UpstreamMetrics()

    async def upstream_metrics(request: Request, record: RequestRecord) -> Response:
        # Unlike the probes, a request like the others (wrap: behind the gateway keys, in a slot, counted): it
        # sends the upstream key to vLLM. Cached: one upstream scrape per second at most.
        answer = await vllm_metrics.get(services().upstream)
        return Response(answer.body, status_code=answer.status, headers=_NO_STORE,
                        media_type=answer.content_type or CONTENT_TYPE_LATEST)

    return Route("/upstream/metrics", wrap("/upstream/metrics", upstream_metrics), methods=["GET"])


def proxy_route(services: Callable[[], Services], wrap: Wrap, settings: Settings) -> Route:
    async def proxy(request: Request, record: RequestRecord) -> Response:
        upstream = services().upstream
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

        def broken() -> None:
            record.upstream_error = "stream_broken"

        return StreamingResponse(up.relay(broken), status_code=up.status_code, headers=headers)

    return Route("/{path:path}", wrap("proxy", proxy), methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                                               "OPTIONS"])
