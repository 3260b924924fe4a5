"""What the doors share once the lifespan has started: built there, read by the route handlers."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engine.background import BackgroundRuns
from gateway.engine.respond import ResponsesHandler
from gateway.errors import NotFound
from gateway.store import ResponseStore
from gateway.upstream.client import UpstreamClient

__all__ = ["Services", "ServicesRef"]


@dataclass(frozen=True, slots=True)
class Services:
    upstream: UpstreamClient
    store: ResponseStore | None
    background: BackgroundRuns | None  # None without a store
    responses: ResponsesHandler  # the engine

    def require_store(self) -> ResponseStore:
        if self.store is None:
            raise NotFound("Stored responses are disabled on this gateway (--store none).", code="store_disabled")
        return self.store


class ServicesRef:
    """The routes are built before the lifespan runs; they read the services through this."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Services | None = None

    def __call__(self) -> Services:
        if self.current is None:
            raise RuntimeError("the gateway's lifespan has not started")
        return self.current
