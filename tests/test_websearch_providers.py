"""The web-search providers (gateway/websearch/providers.py) against local fakes that answer in each provider's
documented JSON shape (tests/websearch_fakes.py): requests, result mapping, bounds, errors, timeouts, the address
rules, live=False, keys kept out of logs; the per-key rate limiter; the demo provider; the flags."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Sequence
from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from gateway.config import Settings, load_settings
from gateway.websearch import providers
from gateway.websearch.base import SearchError, SearchQuery, SearchResult
from gateway.websearch.providers import (
    BraveProvider,
    DemoProvider,
    SearxngProvider,
    TavilyProvider,
    WebSearchRateLimited,
    WebSearchRateLimiter,
    bound_results,
    build_provider,
    startup_fields,
)
from tests.websearch_fakes import FakeProvider

BRAVE_KEY = "BSA-test-key-0123456789-never-logged"
TAVILY_KEY = "tvly-test-key-0123456789-never-logged"


def _settings(kind: str, url: str | None, **kw: Any) -> Settings:
    return Settings(web_search_provider=kind, web_search_url=url, brave_api_key=BRAVE_KEY,  # type: ignore[arg-type]
                    tavily_api_key=TAVILY_KEY, web_search_timeout=kw.pop("timeout", 5.0), **kw)


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> Any:
    server = FakeProvider(request.param).start()
    yield server
    server.stop()


def q(text: str = "search engines", **kw: Any) -> SearchQuery:
    return SearchQuery(query=text, max_results=kw.pop("max_results", 5), **kw)


ALL = ["searxng", "brave", "tavily"]


# --- the happy path, per provider -----------------------------------------------------------------------------

@pytest.mark.parametrize("fake", ["searxng"], indirect=True)
async def test_searxng_sends_its_json_api_query_and_maps_results(fake: FakeProvider) -> None:
    provider = build_provider(_settings("searxng", fake.url + "/"))
    assert provider is not None and provider.name == "searxng"
    try:
        found = await provider.search(q("searxng"))
    finally:
        await provider.aclose()
    seen = fake.requests[-1]
    assert (seen.method, seen.path) == ("GET", "/search")
    assert seen.query["format"] == ["json"] and seen.query["q"] == ["searxng"]
    assert [r.url for r in found.results] == ["https://github.com/searxng/searxng", "https://docs.searxng.org/"]
    # entities and tags are stripped: the model gets text
    assert found.results[1].title == "Welcome to SearXNG — SearXNG Documentation"
    assert found.results[1].snippet.startswith("Search without being tracked.")


@pytest.mark.parametrize("fake", ["brave"], indirect=True)
async def test_brave_sends_token_count_location_and_maps_extra_snippets(fake: FakeProvider) -> None:
    provider = build_provider(_settings("brave", fake.url))
    assert provider is not None
    try:
        found = await provider.search(q("brave search", max_results=3, country="de", city="Berlin",
                                        timezone="Europe/Berlin", context_size="high"))
        await provider.search(q("brave search", city="München"))
    finally:
        await provider.aclose()
    first, second = fake.requests
    assert first.path == "/res/v1/web/search"
    assert first.headers["x-subscription-token"] == BRAVE_KEY
    assert first.query["count"] == ["3"] and first.query["country"] == ["DE"]
    assert first.query["extra_snippets"] == ["true"] and first.query["text_decorations"] == ["false"]
    assert first.headers["x-loc-city"] == "Berlin" and first.headers["x-loc-timezone"] == "Europe/Berlin"
    assert "x-loc-city" not in second.headers  # not ASCII: not sendable as a header, so not sent
    assert found.results[0].url == "https://search.brave.com/"
    assert "does not track you" in found.results[0].snippet  # description + extra_snippets
    assert "<strong>" not in found.results[0].snippet


@pytest.mark.parametrize("fake", ["tavily"], indirect=True)
async def test_tavily_posts_bearer_depth_and_include_domains(fake: FakeProvider) -> None:
    provider = build_provider(_settings("tavily", fake.url))
    assert provider is not None
    try:
        found = await provider.search(q("Who is Leo Messi?", allowed_domains=("https://Wikipedia.org/",),
                                        context_size="high"))
        await provider.search(q("Who is Leo Messi?", context_size="low"))
    finally:
        await provider.aclose()
    first, second = fake.requests
    assert (first.method, first.path) == ("POST", "/search")
    assert first.headers["authorization"] == f"Bearer {TAVILY_KEY}"
    body = json.loads(first.body)
    assert body["include_domains"] == ["wikipedia.org"] and body["search_depth"] == "advanced"
    assert body["max_results"] == 5 and body["include_raw_content"] is False
    assert json.loads(second.body)["search_depth"] == "basic" and "include_domains" not in json.loads(second.body)
    # the fake ignores include_domains: the gateway's own filter still drops britannica.com
    assert [r.url for r in found.results] == ["https://en.wikipedia.org/wiki/Lionel_Messi"]


@pytest.mark.parametrize("fake", ALL, indirect=True)
async def test_allowed_domains_go_to_the_provider_and_filter_after(fake: FakeProvider) -> None:
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        found = await provider.search(q("x", allowed_domains=("docs.searxng.org", "brave.com", "britannica.com")))
        one = await provider.search(q("x", allowed_domains=("github.com",)))
    finally:
        await provider.aclose()
    sent = fake.requests[0]
    if fake.kind in ("searxng", "brave"):
        assert sent.query["q"] == ["x (site:docs.searxng.org OR site:brave.com OR site:britannica.com)"]
        assert fake.requests[1].query["q"] == ["x site:github.com"]
    expected = {"searxng": ["https://docs.searxng.org/"],  # a domain allows its subdomains:
                "brave": ["https://search.brave.com/", "https://brave.com/search/api/"],
                "tavily": ["https://www.britannica.com/facts/Lionel-Messi"]}[fake.kind]
    assert [r.url for r in found.results] == expected
    assert all(r.url.startswith("https://github.com/") for r in one.results)


@pytest.mark.parametrize("fake", ALL, indirect=True)
async def test_empty_results(fake: FakeProvider) -> None:
    fake.mode = "empty"
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        assert (await provider.search(q("zzzz"))).results == ()
    finally:
        await provider.aclose()


@pytest.mark.parametrize("fake", ALL, indirect=True)
async def test_results_are_bounded_by_count_and_bytes(fake: FakeProvider) -> None:
    provider = build_provider(_settings(fake.kind, fake.url, web_search_max_results=1,
                                       web_search_max_result_bytes=64))
    assert provider is not None
    try:
        found = await provider.search(q(max_results=5, context_size="high"))
        low = await provider.search(q(max_results=5, context_size="low"))
    finally:
        await provider.aclose()
    assert len(found.results) == 1 and len(found.results[0].snippet.encode()) <= 64
    assert len(low.results[0].snippet.encode()) <= 32  # max(32, 64 // 4)


# --- errors: statuses, timeouts, bodies -----------------------------------------------------------------------

@pytest.mark.parametrize("fake", ALL, indirect=True)
@pytest.mark.parametrize(("status", "words"), [(401, "credentials (HTTP 401)"), (403, "credentials (HTTP 403)"),
                                               (429, "rate limit was reached (HTTP 429)"), (500, "HTTP 500")])
async def test_http_errors_become_search_errors_without_the_body(fake: FakeProvider, status: int, words: str) -> None:
    fake.mode = f"status:{status}"
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        with pytest.raises(SearchError) as caught:
            await provider.search(q())
    finally:
        await provider.aclose()
    message = str(caught.value)
    assert words in message
    assert "invalid" not in message.lower() and "Forbidden" not in message  # the provider's body is not echoed


@pytest.mark.parametrize("fake", ALL, indirect=True)
@pytest.mark.parametrize("mode", ["hang", "drip"])
async def test_a_slow_provider_times_out(fake: FakeProvider, mode: str) -> None:
    fake.mode = mode
    provider = build_provider(_settings(fake.kind, fake.url, timeout=0.5))
    assert provider is not None
    try:
        with pytest.raises(SearchError, match="did not answer in time"):
            await provider.search(q())
    finally:
        fake.release.set()
        await provider.aclose()


@pytest.mark.parametrize("fake", ALL, indirect=True)
@pytest.mark.parametrize("mode", ["huge", "huge-chunked"])
async def test_an_oversized_body_is_refused(fake: FakeProvider, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "MAX_BODY_BYTES", 1024 * 1024)
    fake.mode = mode
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        with pytest.raises(SearchError, match="too large"):
            await provider.search(q())
    finally:
        await provider.aclose()


@pytest.mark.parametrize("fake", ALL, indirect=True)
@pytest.mark.parametrize(("mode", "words"), [("not-json", "not JSON"), ("shape", "unexpected shape"),
                                             ("redirect", "HTTP 302")])
async def test_bad_answers_and_redirects(fake: FakeProvider, mode: str, words: str) -> None:
    fake.mode = mode
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        with pytest.raises(SearchError, match=words):
            await provider.search(q())
    finally:
        await provider.aclose()
    assert len(fake.requests) == 1  # a redirect is not followed (it pointed at the metadata address)


async def test_an_unreachable_provider() -> None:
    provider = build_provider(_settings("searxng", "http://127.0.0.1:9"))  # discard port: nothing listens
    assert provider is not None
    try:
        with pytest.raises(SearchError, match="could not be reached"):
            await provider.search(q())
    finally:
        await provider.aclose()


async def test_a_name_that_does_not_resolve() -> None:
    async def nowhere(host: str, port: int) -> Sequence[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    for kind in ALL:
        provider = build_provider(_settings(kind, f"http://{kind}.invalid:8888" if kind == "searxng" else None),
                                  resolver=nowhere)
        assert provider is not None
        try:
            with pytest.raises(SearchError, match="did not resolve"):
                await provider.search(q())
        finally:
            await provider.aclose()


# --- the address rules ----------------------------------------------------------------------------------------

def _resolver(table: dict[str, Sequence[str]], asked: list[str]) -> Any:
    async def resolve(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        return table[host]
    return resolve


@pytest.mark.parametrize(("kind", "address"), [("brave", "169.254.169.254"), ("tavily", "127.0.0.1"),
                                               ("brave", "10.0.0.7"), ("tavily", "::ffff:169.254.169.254")])
async def test_a_provider_host_resolving_to_a_refused_address_is_never_connected(kind: str, address: str) -> None:
    """The default API hosts are not the operator's --web-search-url: they must resolve to public addresses."""
    fake = FakeProvider(kind).start()  # listening on 127.0.0.1: it must see nothing
    asked: list[str] = []
    host = "api.search.brave.com" if kind == "brave" else "api.tavily.com"
    provider = build_provider(_settings(kind, None), resolver=_resolver({host: [address]}, asked))
    assert provider is not None
    try:
        with capture_logs() as logs, pytest.raises(SearchError, match="refused by the gateway's address rules"):
            await provider.search(q())
    finally:
        await provider.aclose()
        fake.stop()
    assert asked == [host] and fake.requests == []
    assert any(e["event"] == "web_search_address_refused" for e in logs)


async def test_the_configured_url_host_is_allowed_even_on_a_private_address() -> None:
    """--web-search-url names the host: a SearXNG on the cluster network (here a name resolving to loopback)."""
    fake = FakeProvider("searxng").start()
    asked: list[str] = []
    provider = build_provider(_settings("searxng", f"http://searx.cluster.local:{fake.port}"),
                              resolver=_resolver({"searx.cluster.local": ["127.0.0.1"]}, asked))
    assert provider is not None
    try:
        found = await provider.search(q())
    finally:
        await provider.aclose()
        fake.stop()
    assert asked == ["searx.cluster.local"] and len(found.results) == 2
    assert fake.requests[0].headers["host"] == f"searx.cluster.local:{fake.port}"


async def test_the_configured_url_may_even_resolve_to_the_metadata_address() -> None:
    """The operator's --web-search-url is trusted whatever it resolves to (169.254.169.254 here): the connection is
    attempted, on exactly that address (a stub network backend records it and fails it)."""
    import httpcore2

    attempted: list[tuple[str, int]] = []

    class Recorder(httpcore2.AsyncNetworkBackend):
        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: str | None = None, socket_options: Any = None) -> Any:
            attempted.append((host, port))
            raise httpcore2.ConnectError("stub: no network here")

    asked: list[str] = []
    provider = build_provider(_settings("searxng", "http://metadata-proxy.internal:8080"),
                              resolver=_resolver({"metadata-proxy.internal": ["169.254.169.254"]}, asked))
    assert isinstance(provider, SearxngProvider)
    provider.backend._inner = Recorder()
    try:
        with pytest.raises(SearchError, match="could not be reached"):
            await provider.search(q())
    finally:
        await provider.aclose()
    assert attempted == [("169.254.169.254", 8080)]


async def test_only_the_configured_port_is_trusted() -> None:
    """The operator's host:port is trusted, not the host on any port: a metadata literal on another port is
    refused like any request URL."""
    from gateway.mcp.session import PinnedBackend

    provider = build_provider(_settings("searxng", "http://169.254.169.254:8888"))
    assert isinstance(provider, SearxngProvider)
    try:
        backend: PinnedBackend = provider.backend
        with pytest.raises(Exception, match="metadata"):
            await backend.connect_tcp("169.254.169.254", 80, timeout=1)
    finally:
        await provider.aclose()


async def test_environment_proxies_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeProvider("searxng").start()
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # would fail every request if honoured
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    provider = build_provider(_settings("searxng", fake.url))
    assert provider is not None
    try:
        assert len((await provider.search(q())).results) == 2
    finally:
        await provider.aclose()
        fake.stop()


# --- secrets --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fake", ["brave", "tavily"], indirect=True)
async def test_keys_are_never_in_logs_errors_or_reprs(fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = BRAVE_KEY if fake.kind == "brave" else TAVILY_KEY
    settings_ = _settings(fake.kind, fake.url, log_level="debug")
    provider = build_provider(settings_)
    assert provider is not None
    texts: list[str] = [repr(settings_), repr(provider), json.dumps(startup_fields(settings_))]
    try:
        with capture_logs() as logs:
            await provider.search(q("secret query"))
            fake.mode = "status:401"
            with pytest.raises(SearchError) as caught:
                await provider.search(q("secret query 2"))
            texts.append(str(caught.value))
    finally:
        await provider.aclose()
    texts += [json.dumps(e, default=str) for e in logs] + [r.getMessage() for r in caplog.records]
    assert fake.requests[0].headers  # the key did travel, in a header
    assert any("web_search_failed" in t for t in texts)  # the failure was logged...
    assert not [t for t in texts if key in t or "secret query" in t]  # ...without the key or the query


# --- live=False -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fake", ALL, indirect=True)
async def test_live_false_answers_from_the_same_owners_earlier_results_only(fake: FakeProvider) -> None:
    provider = build_provider(_settings(fake.kind, fake.url))
    assert provider is not None
    try:
        with pytest.raises(SearchError, match=r"^live web access disabled$"):
            await provider.search(q("news", live=False, owner="alice"))
        live = await provider.search(q("news", owner="alice"))
        cached = await provider.search(q("  News ", live=False, owner="alice"))
        with pytest.raises(SearchError, match="live web access disabled"):
            await provider.search(q("news", live=False, owner="bob"))
    finally:
        await provider.aclose()
    assert cached == live and len(fake.requests) == 1  # only the live search reached the provider


async def test_the_cache_is_bounded() -> None:
    cache = providers._ResultCache(entries=3)
    results = bound_results([], q(), max_results=5, max_result_bytes=64)
    for i in range(10):
        cache.put(q(f"query {i}"), results)
    assert len(cache._data) == 3 and cache.get(q("query 0")) is None and cache.get(q("query 9")) is results


# --- the demo provider ----------------------------------------------------------------------------------------

async def test_demo_provider_answers_offline_with_bounds() -> None:
    provider = build_provider(Settings(web_search_provider="demo", web_search_max_result_bytes=64))
    assert isinstance(provider, DemoProvider) and provider.name == "demo"
    found = await provider.search(q("vLLM tool calling", live=False, max_results=2))
    assert [r.url for r in found.results] == ["https://docs.vllm.ai/en/latest/features/tool_calling.html",
                                              "https://docs.vllm.ai/en/latest/"]
    assert all(len(r.snippet.encode()) <= 32 for r in found.results)  # medium: half of 64
    only = await provider.search(q("web search", allowed_domains=("openai.com",)))
    assert only.results and all(r.url.startswith("https://platform.openai.com/") for r in only.results)
    assert (await provider.search(q("zzzzqqq"))).results == ()
    with pytest.raises(SearchError, match="empty"):
        await provider.search(q("   "))
    await provider.aclose()


def test_build_provider_off_and_misconfigured() -> None:
    assert build_provider(Settings()) is None
    with pytest.raises(ValueError, match="--web-search-url"):
        build_provider(Settings(web_search_provider="searxng"))
    with pytest.raises(ValueError, match="GATEWAY_BRAVE_API_KEY"):
        build_provider(Settings(web_search_provider="brave"))
    with pytest.raises(ValueError, match="GATEWAY_TAVILY_API_KEY"):
        build_provider(Settings(web_search_provider="tavily"))
    with pytest.raises(ValueError):
        build_provider(Settings(web_search_provider="searxng", web_search_url="ftp://x.example/"))
    assert isinstance(build_provider(Settings(web_search_provider="brave", brave_api_key="k")), BraveProvider)
    urls = {u: SearxngProvider(Settings(web_search_url=u)).url for u in (
        "http://searx.lan:8888", "http://searx.lan:8888/searxng/", "http://searx.lan:8888/search")}
    assert urls == {"http://searx.lan:8888": "http://searx.lan:8888/search",
                    "http://searx.lan:8888/searxng/": "http://searx.lan:8888/searxng/search",
                    "http://searx.lan:8888/search": "http://searx.lan:8888/search"}
    proxied = BraveProvider(Settings(web_search_url="https://proxy.corp/brave", brave_api_key="k"))
    assert proxied.url == "https://proxy.corp/brave/res/v1/web/search"
    assert isinstance(build_provider(Settings(web_search_provider="tavily", tavily_api_key="k")), TavilyProvider)


# --- flags and the start-up line ------------------------------------------------------------------------------

def test_flags_and_env() -> None:
    env = {"GATEWAY_WEB_SEARCH_PROVIDER": "brave", "GATEWAY_BRAVE_API_KEY": BRAVE_KEY,
           "GATEWAY_WEB_SEARCH_MAX_RESULTS": "3", "GATEWAY_WEB_SEARCH_PER_KEY_PER_MINUTE": "0"}
    loaded = load_settings(None, env=env)
    assert (loaded.web_search_provider, loaded.brave_api_key, loaded.web_search_max_results,
            loaded.web_search_per_key_per_minute) == ("brave", BRAVE_KEY, 3, 0)
    assert BRAVE_KEY not in repr(loaded)
    assert load_settings(None, env={}).web_search_provider is None  # off by default
    for bad in ({"GATEWAY_WEB_SEARCH_PROVIDER": "google"}, {"GATEWAY_WEB_SEARCH_MAX_RESULTS": "0"},
                {"GATEWAY_WEB_SEARCH_TIMEOUT": "0"}, {"GATEWAY_WEB_SEARCH_PER_KEY_PER_MINUTE": "-1"}):
        with pytest.raises(SystemExit):
            load_settings(None, env=bad)


def test_startup_fields_say_on_or_off_and_never_the_key() -> None:
    off = startup_fields(Settings())
    assert off["enabled"] is False and "passed upstream" in off["message"]
    on = startup_fields(Settings(web_search_provider="searxng", web_search_url="http://user:pw@searx.lan:8888/x"))
    assert on["enabled"] is True and on["provider"] == "searxng" and on["host"] == "searx.lan"
    assert "pw" not in json.dumps(on)


def test_demo_command_turns_on_the_demo_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import cli

    captured: dict[str, Settings] = {}
    monkeypatch.delenv("GATEWAY_WEB_SEARCH_PROVIDER", raising=False)
    monkeypatch.setattr(cli, "run", lambda s, demo=False: captured.setdefault("s", s) and 0)
    monkeypatch.setattr("gateway.demo_mcp.start_demo_mcp", lambda: "http://127.0.0.1:9/mcp")
    cli.main(["demo"])
    assert captured["s"].web_search_provider == "demo"


# --- the per-key rate limiter ---------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_sliding_minute_per_owner() -> None:
    clock = Clock()
    limiter = WebSearchRateLimiter(3, clock=clock)
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b") and limiter.allow(None)  # other owners have their own budgets
    clock.now += 30
    assert not limiter.allow("a") and limiter.retry_after("a") == 30
    clock.now += 30
    assert limiter.allow("a")  # the first three stamps left the window


def test_rate_limiter_raises_openai_shaped_429() -> None:
    limiter = WebSearchRateLimiter(1, clock=Clock())
    limiter.check("a")
    with pytest.raises(WebSearchRateLimited) as caught:
        limiter.check("a")
    err = caught.value
    assert err.status == 429 and err.headers["Retry-After"] == "60"
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "--web-search-per-key-per-minute" in body["message"]


def test_rate_limiter_zero_is_unbounded_and_its_map_is_bounded() -> None:
    assert all(WebSearchRateLimiter(0).allow("a") for _ in range(1000))
    clock = Clock()
    limiter = WebSearchRateLimiter(2, max_owners=100, clock=clock)
    for i in range(10_000):  # an attacker rotating owners (keys) cannot grow the map
        limiter.allow(f"owner-{i}")
    assert len(limiter._stamps) <= 100
    assert "owner-9999" in limiter._stamps and "owner-0" not in limiter._stamps  # the newest are kept
    assert limiter.allow("owner-9999") and not limiter.allow("owner-9999")  # its window survived: 2 of 2 used


# --- bounds, as properties --------------------------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)


@settings(max_examples=150, deadline=None)
@given(raw=st.lists(st.tuples(st.sampled_from(["https://a.example/x", "http://sub.b.example/", "ftp://a.example/",
                                               "javascript:alert(1)", "https://evil.example/a.example", ""]),
                              _text, _text), max_size=12),
       max_results=st.integers(0, 8), cap=st.integers(1, 8), max_bytes=st.integers(64, 512),
       size=st.sampled_from(["low", "medium", "high"]),
       domains=st.sampled_from([(), ("a.example",), ("b.example", "a.example")]))
def test_bound_results_properties(raw: list[tuple[str, str, str]], max_results: int, cap: int, max_bytes: int,
                                  size: str, domains: tuple[str, ...]) -> None:
    query = SearchQuery("x", max_results, allowed_domains=domains, context_size=size)
    out = bound_results([SearchResult(*r) for r in raw], query, max_results=cap, max_result_bytes=max_bytes).results
    assert len(out) <= min(max_results, cap)
    assert len({r.url for r in out}) == len(out)
    budget = providers.snippet_budget(max_bytes, size)
    for r in out:
        assert r.url.startswith(("http://", "https://"))
        assert len(r.snippet.encode()) <= budget and len(r.title.encode()) <= 512
        if domains:
            assert providers.domain_allowed(r.url, domains)
            assert "evil.example" not in r.url


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["results", "web", "url", "title", "content", "description",
                                          "extra_snippets", "x"]), inner, max_size=5), max_leaves=20)
# the parsers only: instances without a client (the parsing uses no connection)
_PARSERS = [object.__new__(cls) for cls in (SearxngProvider, BraveProvider, TavilyProvider)]


@settings(max_examples=150, deadline=None)
@given(payload=_json)
def test_any_json_answer_parses_or_fails_as_a_search_error(payload: Any) -> None:
    """Whatever JSON a provider (or something pretending to be one) answers, the parser yields results or a
    SearchError: never another exception (which would become a 500 in the engine)."""
    for provider in _PARSERS:
        try:
            results = provider._results(payload)
        except SearchError:
            continue
        bounded = bound_results(results, q(max_results=20), max_results=20, max_result_bytes=256)
        assert all(isinstance(r.url, str) and isinstance(r.snippet, str) for r in bounded.results)


def test_domain_allowed_subdomains_not_suffixes() -> None:
    assert providers.domain_allowed("https://docs.example.com/a", ["example.com"])
    assert providers.domain_allowed("https://example.com/", ["https://EXAMPLE.com/path"])
    assert not providers.domain_allowed("https://badexample.com/", ["example.com"])
    assert not providers.domain_allowed("https://example.com.evil.net/", ["example.com"])



def test_the_startup_log_line_names_the_provider_not_the_key(monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    from gateway import cli

    monkeypatch.setattr(cli, "_serve", lambda settings, **kw: 0)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        for settings_, enabled in ((Settings(store="none"), False),
                                   (Settings(store="none", web_search_provider="brave", brave_api_key=BRAVE_KEY),
                                    True)):
            assert cli.run(settings_) == 0  # configures the JSON log handler on stderr, then logs the line
            err = capfd.readouterr().err
            lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
            line = next(e for e in lines if e["event"] == "web_search")
            assert line["enabled"] is enabled and (not enabled or line["provider"] == "brave")
            assert BRAVE_KEY not in err
    finally:
        # cli.run pointed structlog and the root logger at this test's captured stderr, which closes with it: a
        # later test's server would log into a closed file and fail to start.
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()


def test_rate_limiter_from_settings_splits_the_budget_between_workers() -> None:
    assert WebSearchRateLimiter.from_settings(Settings(web_search_per_key_per_minute=30)).per_minute == 30
    assert WebSearchRateLimiter.from_settings(Settings(web_search_per_key_per_minute=30, workers=4)).per_minute == 7
    assert WebSearchRateLimiter.from_settings(Settings(web_search_per_key_per_minute=2, workers=4)).per_minute == 1
    assert WebSearchRateLimiter.from_settings(Settings(web_search_per_key_per_minute=0, workers=4)).per_minute == 0
