"""Runs one response's web searches (issue 21) for the tool loop (gateway.engine.tool_loop): the request's
``web_search`` tool and the model's query become a ``SearchQuery``; the configured provider
(gateway.websearch) answers, bounded by ``--web-search-timeout``; the results become the text the model reads
and the ``web_search_call`` item the client sees (gateway.translate.web_search).

A search never fails the response: a provider that errs, times out or is refused becomes a ``web_search_call``
with status ``failed``, and the model is told the search failed. Bounds, checked before the provider is asked:
``max_tool_calls`` and ``--max-tool-rounds`` (the loop's, shared with MCP calls), ``--web-search-max-calls-per-
response``, and the per-key rate (``--web-search-per-key-per-minute``). The rate is checked twice: a request with
a web search tool from a key that has no searches left this minute is a 429 before its response starts
(gateway.engine.respond; nothing is counted for it); a response that runs past the rate while it runs gets a
failed ``web_search_call`` for each search beyond it, and goes on. Queries, results and keys are never logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.translate.web_search import SOURCES_INCLUDE, results_text, search_item
from gateway.websearch.base import SearchError, SearchProvider, SearchQuery, SearchResults

log = structlog.get_logger("gateway.websearch")

__all__ = ["SearchOutcome", "WebSearchRunner", "search_query"]

_CONTEXT_SIZES = ("low", "medium", "high")
# Results per search by search_context_size when the operator sets no --web-search-max-results.
_PER_SIZE = {"low": 3, "medium": 5, "high": 10}


def _host(domain: Any) -> str | None:
    """A filters.allowed_domains entry as a bare host (``https://x.org/a`` → ``x.org``)."""
    if not isinstance(domain, str) or not domain.strip():
        return None
    text = domain.strip().lower()
    text = text.split("://", 1)[-1]
    return text.split("/", 1)[0].split(":", 1)[0] or None


def search_query(tool: Mapping[str, Any], query: str, max_results: int | None, owner: str | None = None
                 ) -> SearchQuery:
    """The provider's query from the request's web search tool (filters, user_location, search_context_size,
    Codex's ``external_web_access``) and the model's query text."""
    size = tool.get("search_context_size")
    size = size if size in _CONTEXT_SIZES else "medium"
    filters: Mapping[str, Any] = raw if isinstance(raw := tool.get("filters"), dict) else {}
    domains: list[Any] = raw if isinstance(raw := filters.get("allowed_domains"), list) else []
    loc: Mapping[str, Any] = raw if isinstance(raw := tool.get("user_location"), dict) else {}

    def text(key: str) -> str | None:
        value = loc.get(key)
        return value.strip()[:100] if isinstance(value, str) and value.strip() else None

    count = max_results if max_results else _PER_SIZE[size]
    return SearchQuery(query=query, max_results=max(1, min(count, _PER_SIZE["high"] * 5)),
                       allowed_domains=tuple(h for d in domains[:50] if (h := _host(d))),
                       country=text("country"), region=text("region"), city=text("city"),
                       timezone=text("timezone"), context_size=size,
                       live=tool.get("external_web_access") is not False, owner=owner)


@dataclass(slots=True)
class SearchOutcome:
    """One search as the loop shows it: the client's done item, the text the model reads, the sources to cite."""

    item: dict[str, Any]
    output: str
    sources: list[tuple[str, str]] = field(default_factory=list)


class WebSearchRunner:
    """One response's searches. ``allow(owner)``: the per-key rate limiter's verdict (None: no limit);
    ``seal(item_id, text)``: the results sealed for the item's ``encrypted_content`` (None: nothing sealed)."""

    def __init__(self, provider: SearchProvider, settings: Any, tool: Mapping[str, Any], body: Mapping[str, Any],
                 *, owner: str | None = None, allow: Callable[[str | None], bool] | None = None,
                 seal: Callable[[str, str], str] | None = None, request_id: str | None = None,
                 outcomes: list[tuple[str, str]] | None = None) -> None:
        self.provider = provider
        self.tool = tool
        self.owner = owner
        self.allow = allow
        self.seal = seal
        self.request_id = request_id
        self.counted = outcomes if outcomes is not None else []  # (provider, outcome): the request's metrics
        self.timeout = float(getattr(settings, "web_search_timeout", 10.0) or 10.0)
        self.grace = 1.0
        self.max_results = int(getattr(settings, "web_search_max_results", 0) or 0) or None
        self.max_result_bytes = int(getattr(settings, "web_search_max_result_bytes", 0) or 0) or 2000
        self.max_calls = int(getattr(settings, "web_search_max_calls_per_response", 0) or 0) or None
        include = body.get("include")
        self.with_sources = isinstance(include, list) and SOURCES_INCLUDE in include
        self.searches = 0  # run (or refused by the rate) in this response
        self.numbered = 0  # results shown so far: the next search's are numbered after them
        self.outcomes: dict[str, str] = {}  # item id -> the text the model read (the next rounds' history)

    async def run(self, key: str, query: str | None) -> SearchOutcome:
        """Search for ``query`` as the call ``key``; never raises (but for cancellation)."""
        if query is None:
            return self._failed(key, query, "The search call had no 'query'; nothing was searched.", "no_query")
        if self.max_calls is not None and self.searches >= self.max_calls:
            return self._failed(key, query, f"Not searched: this response reached its limit of {self.max_calls} "
                                "web searches.", "limit")
        self.searches += 1
        if self.allow is not None and not self.allow(self.owner):
            return self._failed(key, query, "Not searched: the per-key web search rate limit was reached; try "
                                "again in a minute.", "rate_limited")
        started = time.perf_counter()
        try:
            # The provider bounds its own requests by --web-search-timeout; this bounds the whole search (a
            # provider that hangs past it, retries included) a little later, so the provider's own message wins.
            found = await asyncio.wait_for(self.provider.search(search_query(self.tool, query, self.max_results,
                                                                             self.owner)),
                                           timeout=self.timeout + self.grace)
        except TimeoutError:
            return self._failed(key, query, f"The web search timed out after {self.timeout:g} s.", "timeout",
                                started)
        except SearchError as exc:  # its text is safe to show (gateway.websearch.base)
            return self._failed(key, query, f"The web search failed: {exc}", "error", started)
        except Exception as exc:  # a provider's bug is a failed call, never a failed response
            return self._failed(key, query, f"The web search failed ({type(exc).__name__}).", "error", started)
        return self._completed(key, query, found, started)

    def not_run(self, item: dict[str, Any], why: str) -> dict[str, Any]:
        """A search call the loop's bounds stopped: its failed item, with what the model is told sealed in."""
        self._log("not_run", None, 0)
        return self._sealed(SearchOutcome(item, why)).item

    def _completed(self, key: str, query: str, found: SearchResults, started: float) -> SearchOutcome:
        results = [(r.title or r.url, r.url, r.snippet or "") for r in found.results]
        budget = self.max_result_bytes * max(len(results), 1) + 512
        text = results_text(query, results, self.numbered + 1, budget)
        # Only the results that made it into the text are cited (a marker the model cannot have read is no source).
        shown = [(url, title) for n, (title, url, _) in enumerate(results, self.numbered + 1) if f"[{n}] " in text]
        sources = [url for url, _ in shown] if self.with_sources else None
        item = search_item(key, query, "completed", sources)
        self._log("completed", started, len(shown))
        self.numbered += len(shown)
        return self._sealed(SearchOutcome(item, text, shown))

    def _failed(self, key: str, query: str | None, why: str, outcome: str,
                started: float | None = None) -> SearchOutcome:
        self._log(outcome, started, 0)
        item = search_item(key, query, "failed", [] if self.with_sources else None)
        return self._sealed(SearchOutcome(item, why))

    def _sealed(self, outcome: SearchOutcome) -> SearchOutcome:
        key = str(outcome.item["id"])
        self.outcomes[key] = outcome.output
        if self.seal is not None:
            outcome.item["encrypted_content"] = self.seal(key, outcome.output)
        return outcome

    def _log(self, outcome: str, started: float | None, results: int) -> None:
        self.counted.append((str(getattr(self.provider, "name", "other")), outcome))
        log.info("web_search_call", request_id=self.request_id, provider=getattr(self.provider, "name", "other"),
                 outcome=outcome, results=results,
                 duration_ms=round((time.perf_counter() - started) * 1000, 1) if started is not None else None)
