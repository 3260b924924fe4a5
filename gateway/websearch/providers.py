"""The search engines the gateway runs ``web_search`` tools on (issue 21): SearXNG, Brave Search, Tavily and a
built-in ``demo`` corpus, behind ``gateway.websearch.base.SearchProvider``; ``build_provider(settings)`` picks one.

Theory of operation
-------------------
Each network provider owns one ``httpx2.AsyncClient`` whose every new connection goes through the MCP layer's
``PinnedBackend``: the host is resolved by the gateway, every address is judged by a ``HostPolicy`` of ``*`` (any
public host; loopback, private, link-local, CGNAT and metadata addresses refused, and the gateway's own listen
address) and the connection goes to exactly the address that passed. The one exception is the operator's
``--web-search-url``: its host:port is trusted as the servers file's hosts are (a SearXNG on the cluster network,
a corporate proxy in front of Brave or Tavily). The client ignores ``HTTP(S)_PROXY`` (``trust_env=False``),
follows no redirects (a 3xx is an error: a redirect could lead anywhere) and reads at most ``MAX_BODY_BYTES`` of
an answer; the whole search (connect, answer, body) is bounded by ``--web-search-timeout``.

Results are normalised to ``SearchResult`` (http(s) URLs only, tags and entities stripped, whitespace collapsed),
deduplicated by URL, filtered by ``allowed_domains`` (a domain allows its subdomains, as OpenAI's filter does; the
filter runs after the provider's own, so a provider that ignores ``site:`` cannot leak other hosts), cut to
``min(query.max_results, --web-search-max-results)`` and each snippet clipped, on a UTF-8 boundary, to
``--web-search-max-result-bytes`` at ``search_context_size`` ``high``, half of it at ``medium`` and a quarter at
``low`` (titles to 512 bytes).

What each provider honours:

============== ======================== ===================================== ====================================
tool field     SearXNG                  Brave                                 Tavily
============== ======================== ===================================== ====================================
allowed_domains ``site:`` in ``q``      ``site:`` in ``q``                    ``include_domains``
user_location  not sent (no such        ``country``; ``X-Loc-City``,          not sent (Tavily wants a country
               parameter)               ``X-Loc-State``, ``X-Loc-Timezone``   *name*, the tool gives an ISO code)
context_size   snippet length           snippet length; ``extra_snippets``    snippet length; ``search_depth``
                                        at high                               ``advanced`` at high, else ``basic``
============== ======================== ===================================== ====================================

``live=False`` (Codex's ``external_web_access: false``): the network providers never connect; they answer from a
small in-process cache of this process's earlier live results for the same owner and the same query (LRU, 256
entries), else raise ``SearchError("live web access disabled")``. The demo provider has no network and answers.

Secrets: the keys live in the client's request headers only (never in a URL, repr, log line or error message);
error messages name the HTTP status, never the provider's body. httpx2's loggers, which log URLs (so search
queries) at info, are raised to WARNING unless the operator configured them.
"""

from __future__ import annotations

import asyncio
import html
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx2
import orjson
import structlog

from gateway.config import Settings
from gateway.mcp.hub import _local_addresses
from gateway.mcp.policy import HostPolicy, url_host_port
from gateway.mcp.session import PinnedBackend, Resolver, _default_resolver
from gateway.websearch.base import SearchError, SearchProvider, SearchQuery, SearchResult, SearchResults
from gateway.websearch.limits import (  # re-exported: the limiter and start-up fields live apart (limits.py)
    BRAVE_URL,
    PROVIDERS,
    TAVILY_URL,
    WebSearchRateLimited,
    WebSearchRateLimiter,
    startup_fields,
)

__all__ = [
    "BRAVE_URL", "MAX_BODY_BYTES", "PROVIDERS", "SEARXNG_PATH", "TAVILY_URL", "BraveProvider", "DemoProvider",
    "SearxngProvider", "TavilyProvider", "WebSearchRateLimited", "WebSearchRateLimiter", "bound_results",
    "build_provider", "domain_allowed", "startup_fields",
]

log = structlog.get_logger("gateway.websearch")

SEARXNG_PATH = "/search"
MAX_BODY_BYTES = 4 * 1024 * 1024  # one provider answer; 20 results with extra snippets are well under 1 MiB
LIVE_DISABLED = "live web access disabled"
_TITLE_BYTES = 512
_URL_CHARS = 2048
_QUERY_CHARS = 1000
_BRAVE_QUERY_CHARS = 400  # Brave refuses longer queries (422)
_PROVIDER_MAX_RESULTS = 20  # Brave's count and Tavily's max_results both stop at 20
_CACHE_ENTRIES = 256
# Connections to one provider: searches past it wait for one (within their --web-search-timeout).
_LIMITS = httpx2.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=30.0)
_CONTEXT_SHARE = {"low": 4, "medium": 2, "high": 1}  # divisor of --web-search-max-result-bytes per snippet
_TAG = re.compile(r"<[^>]{0,200}>")
_SPACE = re.compile(r"\s+")


# --- results: normalised, filtered, bounded ---------------------------------------------------------------------

def _normalize_domain(domain: str) -> str:
    """``"https://Docs.Example.com/x"`` → ``"docs.example.com"``: clients send hosts, sometimes URLs."""
    text = domain.strip().lower()
    if "://" in text:
        text = urlsplit(text).hostname or ""
    text = text.split("/", 1)[0].rstrip(".")
    return text[2:] if text.startswith("*.") else text


def domain_allowed(url: str, domains: Iterable[str]) -> bool:
    """Whether ``url``'s host is one of ``domains`` or a subdomain of one (OpenAI's ``allowed_domains``)."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    for domain in domains:
        d = _normalize_domain(domain)
        if d and (host == d or host.endswith("." + d)):
            return True
    return False


def _clip(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: max(0, limit - 3)].decode("utf-8", "ignore").rstrip() + "..."


def _clean(text: Any) -> str:
    if not isinstance(text, str):
        return ""
    return _SPACE.sub(" ", html.unescape(_TAG.sub("", text))).strip()


def _web_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and len(url) <= _URL_CHARS


def snippet_budget(max_result_bytes: int, context_size: str) -> int:
    return max(32, max_result_bytes // _CONTEXT_SHARE.get(context_size, 2))


def bound_results(raw: Iterable[SearchResult], query: SearchQuery, *, max_results: int,
                  max_result_bytes: int) -> SearchResults:
    """The provider's results as the engine gets them (see the module docstring)."""
    limit = max(0, min(query.max_results, max_results))
    budget = snippet_budget(max_result_bytes, query.context_size)
    out: list[SearchResult] = []
    seen: set[str] = set()
    for result in raw:
        if len(out) >= limit:
            break
        url = result.url.strip() if isinstance(result.url, str) else ""
        if not _web_url(url) or url in seen:
            continue
        if query.allowed_domains and not domain_allowed(url, query.allowed_domains):
            continue
        seen.add(url)
        out.append(SearchResult(url=url, title=_clip(_clean(result.title), _TITLE_BYTES),
                                snippet=_clip(_clean(result.snippet), budget)))
    return SearchResults(tuple(out))


def _site_clause(domains: Sequence[str]) -> str:
    """``site:`` operators for engines that read them (SearXNG passes ``q`` to its engines, Brave reads them)."""
    names = [d for d in dict.fromkeys(_normalize_domain(x) for x in domains) if d and " " not in d]
    if not names:
        return ""
    clause = " OR ".join(f"site:{d}" for d in names)
    return f" {clause}" if len(names) == 1 else f" ({clause})"


def _query_text(query: SearchQuery, limit: int = _QUERY_CHARS) -> str:
    text = _SPACE.sub(" ", query.query).strip()
    if not text:
        raise SearchError("the search query is empty")
    return text[:limit]


# --- the in-process cache live=False answers from ---------------------------------------------------------------

CacheKey = tuple[Any, ...]


class _ResultCache:
    """LRU of earlier live results, per owner and query; bounded in entries (each entry is bounded already)."""

    def __init__(self, entries: int = _CACHE_ENTRIES) -> None:
        self._entries = entries
        self._data: OrderedDict[CacheKey, SearchResults] = OrderedDict()

    @staticmethod
    def key(query: SearchQuery) -> CacheKey:
        return (query.owner, _SPACE.sub(" ", query.query).strip().lower(),
                tuple(sorted(_normalize_domain(d) for d in query.allowed_domains)), query.country, query.region,
                query.city, query.context_size, query.max_results)

    def get(self, query: SearchQuery) -> SearchResults | None:
        key = self.key(query)
        found = self._data.get(key)
        if found is not None:
            self._data.move_to_end(key)
        return found

    def put(self, query: SearchQuery, results: SearchResults) -> None:
        key = self.key(query)
        self._data[key] = results
        self._data.move_to_end(key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)


# --- the HTTP providers ---------------------------------------------------------------------------------------

def _status_message(status: int) -> str:
    if status in (401, 403):
        return f"the search provider refused the gateway's credentials (HTTP {status})"
    if status == 429:
        return "the search provider's rate limit was reached (HTTP 429)"
    return f"the search provider answered HTTP {status}"


def _quiet_http_loggers() -> None:
    for name in ("httpx2", "httpcore2"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


class _HttpProvider:
    """What SearXNG, Brave and Tavily share: the pinned client, the bounded read, errors, bounds and the cache."""

    name = "http"
    default_url = ""
    path = ""

    def __init__(self, settings: Settings, *, resolver: Resolver | None = None,
                 policy: HostPolicy | None = None) -> None:
        configured = settings.web_search_url
        base = configured.rstrip("/") if configured else ""
        # a base, or already the endpoint ("https://searx.lan/search"): the path is not doubled
        self.url = (base if base.endswith(self.path) else base + self.path) if configured else self.default_url
        scheme, _, _ = url_host_port(self.url)  # ValueError on a URL without a host: a start-up error
        if scheme not in ("http", "https"):
            raise ValueError(f"--web-search-url must be an http or https URL, not {scheme or 'schemeless'}")
        # PinSource: what PinnedBackend reads on every new connection.
        self._policy: HostPolicy | None = policy or HostPolicy.from_settings(
            "*", listen=(settings.host, settings.port), local_addresses=_local_addresses(settings.host))
        self._resolver: Resolver = resolver or _default_resolver
        self._connect_timeout = settings.web_search_timeout
        self.timeout = settings.web_search_timeout
        self.max_results = settings.web_search_max_results
        self.max_result_bytes = settings.web_search_max_result_bytes
        self.backend = PinnedBackend(self, self.url, configured=bool(configured))
        transport = httpx2.AsyncHTTPTransport(trust_env=False, limits=_LIMITS)
        transport._pool._network_backend = self.backend  # read on every new connection (as gateway.mcp.session)
        self._client = httpx2.AsyncClient(transport=transport, trust_env=False, follow_redirects=False,
                                          timeout=httpx2.Timeout(self.timeout),
                                          headers={"Accept": "application/json",
                                                   "User-Agent": "responses-gateway"})
        self._cache = _ResultCache()
        _quiet_http_loggers()

    def __repr__(self) -> str:  # never the headers (keys)
        return f"<{type(self).__name__} {urlsplit(self.url).hostname}>"

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(self, query: SearchQuery) -> SearchResults:
        if not query.live:
            cached = self._cache.get(query)
            if cached is None:
                raise SearchError(LIVE_DISABLED)
            return cached
        request = self._request(query, _query_text(query), min(query.max_results, self.max_results,
                                                                _PROVIDER_MAX_RESULTS))
        started = time.monotonic()
        try:
            payload = await self._send(request)
            raw = self._results(payload)
        except SearchError as exc:
            log.info("web_search_failed", provider=self.name, reason=str(exc),
                     duration_ms=round((time.monotonic() - started) * 1000))
            raise
        results = bound_results(raw, query, max_results=self.max_results, max_result_bytes=self.max_result_bytes)
        log.debug("web_search", provider=self.name, results=len(results.results),
                  duration_ms=round((time.monotonic() - started) * 1000))
        self._cache.put(query, results)
        return results

    def _request(self, query: SearchQuery, text: str, count: int) -> httpx2.Request:
        raise NotImplementedError

    def _results(self, payload: Any) -> list[SearchResult]:
        raise NotImplementedError

    async def _send(self, request: httpx2.Request) -> Any:
        """The decoded JSON answer, or SearchError (status, timeout, refused address, too large, not JSON)."""
        self.backend.refused = None  # set again if this search's connection is refused
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._client.send(request, stream=True)
                try:
                    if response.status_code != 200:
                        raise SearchError(_status_message(response.status_code))
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                        raise SearchError("the search provider's answer is too large")
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_BODY_BYTES:
                            raise SearchError("the search provider's answer is too large")
                finally:
                    await response.aclose()
        except TimeoutError as exc:
            raise SearchError("the search provider did not answer in time") from exc
        except httpx2.TimeoutException as exc:
            raise SearchError("the search provider did not answer in time") from exc
        except httpx2.ConnectError as exc:
            refused = self.backend.refused
            if refused is not None:
                log.warning("web_search_address_refused", provider=self.name, reason=refused)
                raise SearchError("the search provider's address is refused by the gateway's address rules "
                                  "(loopback, private and metadata addresses need --web-search-url)") from exc
            raise SearchError("the search provider could not be reached") from exc
        except httpx2.HTTPError as exc:
            raise SearchError("the search provider's connection failed") from exc
        except OSError as exc:  # the resolver's (PinnedBackend resolves itself): a name that does not resolve
            raise SearchError("the search provider could not be reached (its name did not resolve)") from exc
        try:
            return orjson.loads(bytes(body))
        except orjson.JSONDecodeError as exc:
            raise SearchError("the search provider's answer is not JSON") from exc


def _entries(payload: Any, *path: str) -> list[Mapping[str, Any]]:
    for name in path:
        payload = payload.get(name) if isinstance(payload, Mapping) else None
    if payload is None:
        return []
    if not isinstance(payload, list):
        raise SearchError("the search provider's answer has an unexpected shape")
    return [entry for entry in payload if isinstance(entry, Mapping)]


def _result(url: Any, title: Any, snippet: Any) -> SearchResult:
    return SearchResult(url=url if isinstance(url, str) else "", title=title if isinstance(title, str) else "",
                        snippet=snippet if isinstance(snippet, str) else "")


def _check_object(payload: Any) -> None:
    if not isinstance(payload, Mapping):
        raise SearchError("the search provider's answer has an unexpected shape")


class SearxngProvider(_HttpProvider):
    """SearXNG's JSON API (``GET {url}/search?q=…&format=json``; the instance must enable the json format, else it
    answers 403). No key; ``--web-search-url`` is required."""

    name = "searxng"
    path = SEARXNG_PATH

    def _request(self, query: SearchQuery, text: str, count: int) -> httpx2.Request:
        params = {"q": text + _site_clause(query.allowed_domains), "format": "json", "categories": "general",
                  "pageno": "1"}
        return self._client.build_request("GET", self.url, params=params)

    def _results(self, payload: Any) -> list[SearchResult]:
        _check_object(payload)
        return [_result(e.get("url"), e.get("title"), e.get("content")) for e in _entries(payload, "results")]


class BraveProvider(_HttpProvider):
    """Brave Search's web search API (``GET …/res/v1/web/search``, ``X-Subscription-Token``)."""

    name = "brave"
    default_url = BRAVE_URL
    path = "/res/v1/web/search"

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        if not settings.brave_api_key:
            raise ValueError("--web-search-provider brave needs GATEWAY_BRAVE_API_KEY")
        self._client.headers["X-Subscription-Token"] = settings.brave_api_key

    def _request(self, query: SearchQuery, text: str, count: int) -> httpx2.Request:
        params = {"q": (text[:_BRAVE_QUERY_CHARS] + _site_clause(query.allowed_domains)),
                  "count": str(max(1, count)), "text_decorations": "false", "result_filter": "web"}
        if query.context_size == "high":
            params["extra_snippets"] = "true"
        headers: dict[str, str] = {}
        if query.country and len(query.country) == 2 and query.country.isalpha():
            params["country"] = query.country.upper()
            headers["X-Loc-Country"] = query.country.upper()
        for header, value in (("X-Loc-City", query.city), ("X-Loc-State-Name", query.region),
                              ("X-Loc-Timezone", query.timezone)):
            if value and value.isascii() and value.isprintable() and len(value) <= 100:
                headers[header] = value  # header values must be ASCII: a non-ASCII city is not sent
        return self._client.build_request("GET", self.url, params=params, headers=headers)

    def _results(self, payload: Any) -> list[SearchResult]:
        _check_object(payload)
        out = []
        for e in _entries(payload, "web", "results"):
            extra = e.get("extra_snippets")
            parts = [e.get("description")] + (list(extra) if isinstance(extra, list) else [])
            out.append(_result(e.get("url"), e.get("title"), " ".join(p for p in parts if isinstance(p, str))))
        return out


class TavilyProvider(_HttpProvider):
    """Tavily's search API (``POST …/search``, ``Authorization: Bearer``)."""

    name = "tavily"
    default_url = TAVILY_URL
    path = "/search"

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        if not settings.tavily_api_key:
            raise ValueError("--web-search-provider tavily needs GATEWAY_TAVILY_API_KEY")
        self._client.headers["Authorization"] = f"Bearer {settings.tavily_api_key}"

    def _request(self, query: SearchQuery, text: str, count: int) -> httpx2.Request:
        body: dict[str, Any] = {
            "query": text, "max_results": max(1, count), "topic": "general",
            "search_depth": "advanced" if query.context_size == "high" else "basic",
            "include_answer": False, "include_raw_content": False, "include_images": False}
        domains = [d for d in dict.fromkeys(_normalize_domain(x) for x in query.allowed_domains) if d]
        if domains:
            body["include_domains"] = domains
        return self._client.build_request("POST", self.url, content=orjson.dumps(body),
                                          headers={"Content-Type": "application/json"})

    def _results(self, payload: Any) -> list[SearchResult]:
        _check_object(payload)
        return [_result(e.get("url"), e.get("title"), e.get("content")) for e in _entries(payload, "results")]


# --- the demo provider ------------------------------------------------------------------------------------------

# A fixed corpus for `responses-gateway demo`: pages about the software around the gateway (their real addresses).
DEMO_CORPUS: tuple[SearchResult, ...] = (
    SearchResult("https://docs.vllm.ai/en/latest/", "vLLM documentation",
                 "vLLM is a fast and easy-to-use library for LLM inference and serving, with PagedAttention, "
                 "continuous batching and an OpenAI-compatible server."),
    SearchResult("https://docs.vllm.ai/en/latest/features/tool_calling.html", "Tool calling - vLLM",
                 "vLLM supports named and automatic function calling with tool parsers such as hermes, selected "
                 "with --enable-auto-tool-choice and --tool-call-parser."),
    SearchResult("https://platform.openai.com/docs/api-reference/responses", "Responses API reference - OpenAI",
                 "The Responses API creates model responses from text, image and file inputs, with built-in tools "
                 "such as web search, file search and remote MCP servers."),
    SearchResult("https://platform.openai.com/docs/guides/tools-web-search", "Web search - OpenAI",
                 "The web_search tool lets the model search the web for the latest information; answers cite "
                 "their sources with url_citation annotations."),
    SearchResult("https://docs.searxng.org/dev/search_api.html", "Search API - SearXNG",
                 "SearXNG answers GET /search?q=...&format=json with a JSON list of results (url, title, "
                 "content) when the json format is enabled in settings.yml."),
    SearchResult("https://modelcontextprotocol.io/introduction", "Model Context Protocol",
                 "MCP is an open protocol that standardizes how applications provide tools and context to "
                 "language models."),
    SearchResult("https://www.python.org/doc/", "Python documentation",
                 "Python is a programming language that lets you work quickly and integrate systems more "
                 "effectively."),
    SearchResult("https://en.wikipedia.org/wiki/Paris", "Paris - Wikipedia",
                 "Paris is the capital and largest city of France, on the Seine; it is known for the Eiffel Tower "
                 "and the Louvre."),
)
_WORD = re.compile(r"[a-z0-9]{3,}")
_STOP = frozenset({"the", "and", "for", "with", "what", "how", "does", "about", "from", "that", "this", "are"})


class DemoProvider:
    """Searches ``DEMO_CORPUS`` by word overlap: no network, so it answers with ``live=False`` too."""

    name = "demo"

    def __init__(self, settings: Settings | None = None, corpus: Sequence[SearchResult] = DEMO_CORPUS) -> None:
        settings = settings or Settings()
        self.max_results = settings.web_search_max_results
        self.max_result_bytes = settings.web_search_max_result_bytes
        self._corpus = [(doc, set(_WORD.findall(f"{doc.title} {doc.snippet} {doc.url}".lower()))) for doc in corpus]

    async def search(self, query: SearchQuery) -> SearchResults:
        words = set(_WORD.findall(_query_text(query).lower())) - _STOP
        scored = [(len(words & vocab), i, doc) for i, (doc, vocab) in enumerate(self._corpus)]
        ranked = [doc for score, _, doc in sorted(scored, key=lambda s: (-s[0], s[1])) if score > 0]
        return bound_results(ranked, query, max_results=self.max_results, max_result_bytes=self.max_result_bytes)

    async def aclose(self) -> None:
        return None


# --- the factory ----------------------------------------------------------------------------------------------

def build_provider(settings: Settings, *, resolver: Resolver | None = None) -> SearchProvider | None:
    """The provider ``--web-search-provider`` names, or None (web search off: ``web_search`` tools pass upstream).
    ValueError (a start-up error) when the provider lacks its URL or key."""
    kind = settings.web_search_provider
    if kind is None:
        return None
    if kind == "demo":
        return DemoProvider(settings)
    if kind == "searxng":
        if not settings.web_search_url:
            raise ValueError("--web-search-provider searxng needs --web-search-url (the SearXNG instance)")
        return SearxngProvider(settings, resolver=resolver)
    if kind == "brave":
        return BraveProvider(settings, resolver=resolver)
    if kind == "tavily":
        return TavilyProvider(settings, resolver=resolver)
    raise ValueError(f"--web-search-provider must be one of {', '.join(PROVIDERS)}, not {kind!r}")
