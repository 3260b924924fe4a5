"""The interface between web-search providers and the engine that runs ``web_search`` tools (issue 21).

INTERFACE: the engine side depends only on these names; providers implement ``SearchProvider``. Fields may be
added (with defaults); none renamed or removed without both sides agreeing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["SearchError", "SearchProvider", "SearchQuery", "SearchResult", "SearchResults"]


@dataclass(frozen=True)
class SearchQuery:
    query: str
    max_results: int
    # filters.allowed_domains of the tool (bare host names); empty = any
    allowed_domains: tuple[str, ...] = ()
    # the tool's user_location: {"type": "approximate", "country", "region", "city", "timezone"} minus the type
    country: str | None = None
    region: str | None = None
    city: str | None = None
    timezone: str | None = None
    # the tool's search_context_size: "low" | "medium" | "high"
    context_size: str = "medium"
    # Codex's external_web_access: false -> no live network access (cached/local only, or SearchError)
    live: bool = True
    # the caller's owner (gateway.server.auth.request_owner; None without gateway keys): live=False answers only
    # from this owner's earlier results, so one tenant cannot probe what another searched
    owner: str | None = None


@dataclass(frozen=True)
class SearchResult:
    url: str
    title: str
    snippet: str


@dataclass(frozen=True)
class SearchResults:
    results: tuple[SearchResult, ...] = field(default_factory=tuple)


class SearchError(Exception):
    """A provider failed (timeout, HTTP error, bad answer, refused address). ``str(exc)`` is safe to show the
    model and the client: it never contains a key or the provider's raw body."""


class SearchProvider(Protocol):
    name: str  # "searxng" | "brave" | "tavily" | "demo" (a bounded metric label)

    async def search(self, query: SearchQuery) -> SearchResults: ...

    async def aclose(self) -> None: ...
