"""Liveness, readiness and vLLM's metrics.

Readiness follows the upstream: vLLM refuses connections while its model loads and answers ``/health`` with
503 once its engine died, so a pod whose gateway is fine but whose vLLM is not must leave the Service.
The probe result is cached briefly: kubelets, load balancers and humans may all poll at once, and vLLM's
``/health`` must not be hammered.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import httpx

from gateway.errors import GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.client import map_transport_error

__all__ = ["MetricsAnswer", "Readiness", "ReadyState", "UpstreamMetrics"]


@dataclass(frozen=True, slots=True)
class ReadyState:
    ready: bool
    reason: str | None = None


class Readiness:
    def __init__(self, *, timeout: float = 2.0, cache_ttl: float = 1.5,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.timeout = timeout
        self.cache_ttl = cache_ttl
        self.draining = draining
        self.probes = 0  # upstream /health calls made (tests read it to see the cache at work)
        self._cached: tuple[float, ReadyState] | None = None
        self._lock = anyio.Lock()

    async def check(self, http: httpx.AsyncClient, headers: dict[str, str] | None = None) -> ReadyState:
        if self.draining():
            return ReadyState(False, "draining")
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.cache_ttl:
            return self._cached[1]
        # One probe at a time: concurrent callers wait for it and share its answer.
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_ttl:
                return self._cached[1]
            state = await self._probe(http, headers or {})
            self._cached = (time.monotonic(), state)
            return state

    async def _probe(self, http: httpx.AsyncClient, headers: dict[str, str]) -> ReadyState:
        self.probes += 1
        try:
            with anyio.fail_after(self.timeout):  # covers a server that accepts but never answers
                response = await http.get("/health", headers=headers, timeout=self.timeout)
        except (TimeoutError, httpx.TimeoutException):
            return ReadyState(False, f"upstream /health did not answer within {self.timeout:g} s")
        except httpx.HTTPError as exc:  # connection refused: vLLM is still loading (or gone)
            return ReadyState(False, f"upstream unreachable ({type(exc).__name__})")
        if response.status_code != 200:
            return ReadyState(False, f"upstream /health answered HTTP {response.status_code}")
        return ReadyState(True)


@dataclass(frozen=True, slots=True)
class MetricsAnswer:
    status: int
    body: bytes
    content_type: str


class UpstreamMetrics:
    """vLLM's ``/metrics``, fetched at most once per ``cache_ttl``: however many scrapers poll the gateway, vLLM
    serves one scrape per period (concurrent callers share the fetch in flight). Only the upstream key goes
    upstream. A failure is cached too, as the gateway error it maps to, so an unreachable vLLM is not retried
    by every scraper either."""

    def __init__(self, *, cache_ttl: float = 1.0, timeout: float = 10.0, max_bytes: int = 32 << 20) -> None:
        self.cache_ttl = cache_ttl
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._cached: tuple[float, MetricsAnswer | GatewayError] | None = None
        self._lock = anyio.Lock()

    async def get(self, http: httpx.AsyncClient, headers: dict[str, str]) -> MetricsAnswer:
        cached = self._cached
        if cached is None or time.monotonic() - cached[0] >= self.cache_ttl:
            async with self._lock:
                cached = self._cached
                if cached is None or time.monotonic() - cached[0] >= self.cache_ttl:
                    cached = self._cached = (time.monotonic(), await self._fetch(http, headers))
        if isinstance(cached[1], GatewayError):
            raise copy.copy(cached[1])  # one instance per raise: concurrent raisers would share a traceback
        return cached[1]

    async def _fetch(self, http: httpx.AsyncClient, headers: dict[str, str]) -> MetricsAnswer | GatewayError:
        try:
            with anyio.fail_after(self.timeout):
                async with http.stream("GET", "/metrics", headers=headers, timeout=self.timeout) as up:
                    body = bytearray()
                    async for chunk in up.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            return UpstreamUnavailable(f"The upstream's metrics exceed {self.max_bytes} bytes.")
                    return MetricsAnswer(up.status_code, bytes(body), up.headers.get("content-type", ""))
        except TimeoutError:
            return UpstreamTimeout(f"The upstream's metrics did not come within {self.timeout:g} s.")
        except httpx.HTTPError as exc:
            return map_transport_error(exc)
