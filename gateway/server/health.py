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

from gateway.errors import GatewayError
from gateway.upstream.client import UpstreamClient

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

    async def check(self, upstream: UpstreamClient) -> ReadyState:
        if self.draining():
            return ReadyState(False, "draining")
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.cache_ttl:
            return self._cached[1]
        # One probe at a time: concurrent callers wait for it and share its answer.
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_ttl:
                return self._cached[1]
            state = await self._probe(upstream)
            self._cached = (time.monotonic(), state)
            return state

    async def _probe(self, upstream: UpstreamClient) -> ReadyState:
        self.probes += 1
        status = await upstream.health_status(self.timeout)
        if isinstance(status, str):  # no answer in time, or unreachable: vLLM is still loading (or gone)
            return ReadyState(False, status)
        if status != 200:
            return ReadyState(False, f"upstream /health answered HTTP {status}")
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

    async def get(self, upstream: UpstreamClient) -> MetricsAnswer:
        cached = self._cached
        if cached is None or time.monotonic() - cached[0] >= self.cache_ttl:
            async with self._lock:
                cached = self._cached
                if cached is None or time.monotonic() - cached[0] >= self.cache_ttl:
                    cached = self._cached = (time.monotonic(), await self._fetch(upstream))
        if isinstance(cached[1], GatewayError):
            raise copy.copy(cached[1])  # one instance per raise: concurrent raisers would share a traceback
        return cached[1]

    async def _fetch(self, upstream: UpstreamClient) -> MetricsAnswer | GatewayError:
        got = await upstream.fetch_metrics(self.timeout, self.max_bytes)
        return got if isinstance(got, GatewayError) else MetricsAnswer(*got)
