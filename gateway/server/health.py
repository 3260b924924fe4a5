"""Liveness and readiness.

Readiness follows the upstream: vLLM refuses connections while its model loads and answers ``/health`` with
503 once its engine died, so a pod whose gateway is fine but whose vLLM is not must leave the Service.
The probe result is cached briefly: kubelets, load balancers and humans may all poll at once, and vLLM's
``/health`` must not be hammered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import httpx

__all__ = ["Readiness", "ReadyState"]


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
