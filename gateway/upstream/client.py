"""HTTP client for the upstream (vLLM). Maps transport failures to the gateway's errors in one place.

httpx is the client API; on the network it runs on httpx-aiohttp's transport (aiohttp's C parser, the
transport the ``openai`` SDK ships), for model requests and the pass-through proxy alike. What the gateway
relies on from it, each pinned by tests/test_upstream_transport.py against raw sockets: an interim ``1xx``
answer never ends a request; a POST whose bytes were written is never sent again (aiohttp retries only
idempotent methods on a reused connection, RFC 9112 §9.3.1); a response closed before its end drops its
connection (so vLLM stops generating) and one read to its end returns it to the pool. ``HTTP_PROXY``,
``HTTPS_PROXY`` and ``NO_PROXY`` are honoured as httpx reads them: httpx mounts one transport per proxy.
Connections are kept alive and reused: a stream that ended on its own terminal event is ``release()``d (the
rest of its body read, bounded) rather than dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from gateway.config import Settings
from gateway.errors import (
    GatewayError,
    StreamFailure,
    UpstreamIdleTimeout,
    UpstreamStreamBroken,
    UpstreamTimeout,
    UpstreamUnavailable,
    normalize_upstream_error,
)

__all__ = ["PROXY_DROP_RESPONSE", "UpstreamClient", "UpstreamResponse", "UpstreamTransport", "map_transport_error"]

# release(): how much of a finished stream's remaining body is read to keep its connection, and for how long.
RELEASE_MAX_BYTES = 64 * 1024
RELEASE_TIMEOUT = 1.0
# Idle upstream connections are closed after this long: below uvicorn's (vLLM's) 5 s keep-alive timeout, so
# the gateway never sends a request on a connection the server is closing at that very moment.
KEEPALIVE_EXPIRY = 3.0

# Headers never forwarded between hops (RFC 9110 §7.6.1) plus ones httpx/uvicorn recompute.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
# The pass-through proxy also keeps the client's credentials (the upstream's go instead, or the client's own
# when the gateway has no upstream key: ``auth_headers``) and cookies from vLLM, vLLM's cookies from the
# client, and ``Expect``: the gateway reads the whole body before forwarding it (uvicorn answered the
# client's ``100-continue``).
PROXY_DROP_REQUEST = HOP_BY_HOP | {"authorization", "cookie", "expect"}
PROXY_DROP_RESPONSE = HOP_BY_HOP | {"set-cookie"}


def map_transport_error(exc: httpx.HTTPError) -> GatewayError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"The upstream did not answer in time ({type(exc).__name__}).")
    return UpstreamUnavailable(f"The upstream could not be reached ({type(exc).__name__}).")


def _mapped(exc: BaseException) -> BaseException:
    """httpx's exception for an aiohttp failure. httpx-aiohttp's own table maps by the first match (a refused
    connection and a server that hung up both become ``ConnectTimeout``) and lets some through unmapped (an
    invalid answer is aiohttp's ``ClientResponseError``): the gateway's errors need the right kind."""
    cause = exc.__cause__ if isinstance(exc, httpx.HTTPError) and exc.__cause__ is not None else exc
    name = type(cause).__name__
    if isinstance(cause, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout(f"No upstream bytes in time ({name}).")
    if isinstance(cause, aiohttp.ConnectionTimeoutError):  # connecting, or waiting for a free connection
        return httpx.ConnectTimeout(f"No upstream connection in time ({name}).")
    if isinstance(cause, TimeoutError):
        return httpx.TimeoutException(f"The upstream timed out ({name}).")
    if isinstance(cause, aiohttp.ClientProxyConnectionError | aiohttp.ClientHttpProxyError):
        return httpx.ProxyError(f"The proxy to the upstream failed ({name}).")
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(f"The upstream refused or is unreachable ({name}).")
    if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(f"The upstream closed the connection or sent invalid HTTP ({name}).")
    if isinstance(cause, aiohttp.ClientError | OSError):
        return httpx.ReadError(f"The upstream connection failed ({name}).")
    return exc


class _Body(httpx.AsyncByteStream):
    """httpx-aiohttp's response stream with ``_mapped`` errors. ``aclose`` before the end of the body drops
    the connection (aiohttp closes a connection whose payload is not at its end); after it, pools it."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except (httpx.HTTPError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _mapped(exc) from exc

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        except (httpx.HTTPError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _mapped(exc) from exc


class UpstreamTransport(AiohttpTransport):
    """httpx-aiohttp's transport on a session fit for a shared gateway: no cookie jar (one upstream client
    serves every gateway client, so no ``Set-Cookie`` may ride along on others' requests), no environment
    reading of its own (httpx mounts a transport per environment proxy; aiohttp's ``trust_env`` would also
    read ``~/.netrc`` credentials), at most ``limits.max_connections`` connections (aiohttp has no separate bound
    on idle ones), closed after ``keepalive_expiry`` idle, and httpx errors of the right kind."""

    def get_client(self) -> aiohttp.ClientSession:
        limit = self.limits.max_connections or 0  # 0: unbounded
        expiry = self.limits.keepalive_expiry
        connector = aiohttp.TCPConnector(limit=limit, ssl=self.ssl_context,
                                         keepalive_timeout=expiry if expiry is not None else 15.0)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except (httpx.HTTPError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _mapped(exc) from exc
        response.stream = _Body(response.stream)  # type: ignore[arg-type]
        return response


@dataclass(slots=True)
class UpstreamResponse:
    """An open upstream response. ``release`` or ``aclose`` must always run; the server does it in ``finally``.

    ``aclose`` aborts (a client that left, a gateway-side failure: the connection is dropped unless the
    body had already arrived whole, so vLLM stops generating); ``release`` ends a response that is complete
    (its terminal event seen) by reading what is left of the body, bounded, so the connection is reused.
    """

    response: httpx.Response
    idle_timeout: float | None = None  # the stream's read timeout (for the failure's message)
    _body: AsyncIterator[bytes] | None = None

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def ok(self) -> bool:
        return 200 <= self.response.status_code < 300

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self.response.aiter_raw()

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The (decoded) body as it arrives, one iterator per response: ``release`` goes on where the reader
        stopped."""
        if self._body is None:
            r = self.response
            # Not encoded (vLLM never compresses) and from our transport: the transport's stream is the body, read
            # without httpx's two layers (aiter_bytes' identity decoder and aiter_raw's chunker and byte count: two
            # more generator hops for every upstream read). ``aclose`` still closes the response. Anything else (an
            # encoded body, a test's mock transport, a response read whole already) goes through aiter_bytes.
            plain = r.headers.get("content-encoding", "identity").strip().lower() in ("", "identity")
            if plain and isinstance(r.stream, _Body) and not r.is_stream_consumed:
                r.is_stream_consumed = True
                self._body = r.stream.__aiter__()
            else:
                self._body = r.aiter_bytes()
        return self._body

    def stream_failure(self, exc: httpx.HTTPError) -> StreamFailure:
        """A transport error met while reading this stream, as the failure that ends the client's response."""
        if isinstance(exc, httpx.ReadTimeout):
            waited = f"{self.idle_timeout:g} seconds" if self.idle_timeout is not None else "too long"
            return UpstreamIdleTimeout(f"No upstream event for {waited}; the gateway ended the stream.")
        return UpstreamStreamBroken(f"The upstream connection broke mid-stream ({type(exc).__name__}).")

    async def relay(self, on_broken: Callable[[], None]) -> AsyncIterator[bytes]:
        """The body as it arrives, undecoded (the pass-through proxy), closed at its end; a transport error ends
        it early (``on_broken`` is told)."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            on_broken()
        finally:
            await self.aclose()

    async def release(self, max_bytes: int = RELEASE_MAX_BYTES, timeout: float = RELEASE_TIMEOUT) -> bool:
        """End a complete response, keeping its connection: read the rest of the body (at most ``max_bytes``,
        for at most ``timeout`` seconds), then close, which returns the connection to the pool. Past either
        bound, on an error or when cancelled, the connection is dropped instead. True if the body ended."""
        if self.response.is_closed:
            return False
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the request is being torn down: no reads now
            await self.aclose()
            return False
        drained = False
        try:
            async with asyncio.timeout(timeout):
                seen = 0
                async for chunk in self.aiter_bytes():
                    seen += len(chunk)
                    if seen > max_bytes:
                        break
                else:
                    drained = True
        except (httpx.HTTPError, httpx.StreamError, TimeoutError):
            pass
        finally:
            await self.aclose()
        return drained

    async def error_body(self, limit: int = 1 << 20) -> dict[str, Any]:
        """The upstream's error, normalized to OpenAI's shape (reading at most ``limit`` bytes)."""
        buf = bytearray()
        try:
            async for chunk in self.aiter_bytes():
                buf += chunk
                if len(buf) > limit:
                    break
        except httpx.HTTPError:
            pass
        try:
            payload: Any = orjson.loads(bytes(buf))
        except orjson.JSONDecodeError:
            payload = {"error": buf[:500].decode("utf-8", "replace")} if buf else None
        return normalize_upstream_error(self.response.status_code, payload)

    async def aclose(self) -> None:
        body = self._body
        if body is not None:
            self._body = None
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
        await self.response.aclose()


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing: one upstream client serves every gateway client, so a ``Set-Cookie``
    from the upstream must not ride along on other clients' requests (and parsing it costs each response)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _Client(httpx.AsyncClient):
    """httpx's client on ``UpstreamTransport``, the way httpx-aiohttp's ``HttpxAiohttpClient`` builds it:
    with no transport given, httpx mounts one ``UpstreamTransport`` per proxy it reads from the environment
    (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, ``NO_PROXY`` excepted), which a transport passed in would
    have turned off."""

    _NO_COOKIES = _NoCookies()

    @property
    def cookies(self) -> httpx.Cookies:
        return self._NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        pass

    # httpx's private hooks, which it calls with keywords only: the positional signature it declares is not kept
    def _init_transport(  # type: ignore[override]
            self, *, transport: httpx.AsyncBaseTransport | None = None, limits: httpx.Limits,
            **kwargs: Any) -> httpx.AsyncBaseTransport:
        if transport is not None:
            return transport
        return UpstreamTransport(limits=limits, verify=kwargs.get("verify", True), cert=kwargs.get("cert"),
                                 trust_env=kwargs.get("trust_env", True))

    def _init_proxy_transport(  # type: ignore[override]
            self, proxy: httpx.Proxy, *, limits: httpx.Limits, **kwargs: Any) -> httpx.AsyncBaseTransport:
        if proxy.url.scheme not in ("http", "https"):  # aiohttp would speak HTTP to it: fail at start-up instead
            raise ValueError(f"Unsupported proxy for the upstream: {proxy.url.scheme}:// (only http:// and https://)")
        return UpstreamTransport(limits=limits, proxy=proxy, verify=kwargs.get("verify", True),
                                 cert=kwargs.get("cert"), trust_env=kwargs.get("trust_env", True))


class UpstreamClient:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        limits = httpx.Limits(max_connections=settings.max_concurrency + 16,
                              max_keepalive_connections=settings.max_concurrency, keepalive_expiry=KEEPALIVE_EXPIRY)
        self._timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
        self._stream_timeout = httpx.Timeout(settings.stream_idle_timeout, connect=settings.connect_timeout)
        self._timeouts = {True: self._stream_timeout.as_dict(), False: self._timeout.as_dict()}
        self._idle_timeout = settings.stream_idle_timeout
        self._urls: dict[str, httpx.URL] = {}
        # A transport given (tests, the demo) replaces the network, environment proxies included.
        self.http = _Client(base_url=settings.upstream_url.rstrip("/"), transport=transport, limits=limits,
                            timeout=self._timeout, trust_env=True)
        self._transport = self.http._transport  # httpx-private, as _route's lookup
        self._routes: dict[str, tuple[httpx.URL, httpx.AsyncBaseTransport]] = {}
        self._proxy_paths = frozenset(settings.proxy_paths)
        # Bumped on every transport failure of a model request: the upstream may have gone away and come back as
        # another server, so what was learnt about it (gateway.engine.grammar_routes) is learnt again.
        self.generation = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    def _url(self, path: str) -> httpx.URL:
        """The absolute URL of an upstream path, parsed once (httpx parses a relative one on every request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.http.base_url.join(path.lstrip("/"))
        return url

    def _route(self, path: str) -> tuple[httpx.URL, httpx.AsyncBaseTransport]:
        """A model path's URL and transport: the one httpx mounted for a proxy the environment configures for it
        (``HTTP_PROXY`` and friends, ``NO_PROXY`` excepted), otherwise the upstream transport."""
        route = self._routes.get(path)
        if route is None:
            url = self._url(path)
            route = self._routes[path] = (url, self.http._transport_for_url(url))  # httpx-private, once per path
        return route

    def auth_headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        if self.settings.upstream_api_key:
            return {"authorization": f"Bearer {self.settings.upstream_api_key}"}
        auth = client_headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def send_json(self, path: str, body: Mapping[str, Any], client_headers: Mapping[str, str], *,
                        stream: bool, extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST a JSON body; the response is returned open (streamed) so the caller decides how to read it.

        For streams the read timeout is the idle timeout: no upstream bytes for that long fails the stream's read
        (``UpstreamIdleTimeout`` from the event readers, gateway.upstream.chat), which ends the client's response
        with ``response.failed``.
        """
        headers = {"content-type": "application/json", "accept": "text/event-stream" if stream else
                   "application/json", **self.auth_headers(client_headers), **(extra_headers or {})}
        # Straight to the transport: every model request takes this path (two per response under constrain),
        # and httpx's client layers around the transport (default-header and cookie merging, auth and
        # redirect loops, the bound stream, a log line per request) cost about as much CPU as the transport's
        # request itself (bench/README.md). The request and response are still httpx's own objects.
        url, transport = self._route(path)
        request = httpx.Request("POST", url, content=orjson.dumps(body), headers=headers,
                                extensions={"timeout": self._timeouts[stream]})
        try:
            response = await transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            self.generation += 1
            raise map_transport_error(exc) from exc
        # The request (its serialized body: the whole conversation, for a long agent session hundreds of KB) is
        # detached from the response, which lives as long as the stream: nothing reads it back (httpx-private).
        response._request = None
        return UpstreamResponse(response, self._idle_timeout if stream else None)

    async def post_json(self, path: str, body: Mapping[str, Any], client_headers: Mapping[str, str]
                        ) -> tuple[int, Any]:
        """A non-streamed POST: ``(status, parsed JSON or error body)``. The body is read whole, so the
        connection goes back to the pool."""
        up = await self.send_json(path, body, client_headers, stream=False)
        try:
            if not up.ok:
                return up.status_code, await up.error_body()
            try:
                raw = await up.response.aread()
            except httpx.HTTPError as exc:
                raise map_transport_error(exc) from exc
            try:
                return up.status_code, orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise UpstreamUnavailable("The upstream answered with a body that is not JSON.") from exc
        finally:
            await up.aclose()

    async def _small_json(self, path: str, headers: Mapping[str, str], max_bytes: int, timeout: float | None = None
                          ) -> tuple[int, Any]:
        """``GET path``: ``(status, parsed JSON)``, None for a body that is not JSON or is larger than ``max_bytes``
        (read no further). httpx errors propagate: each caller maps them its own way."""
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        async with self.http.stream("GET", path, headers=headers, **kwargs) as up:
            body = bytearray()
            async for chunk in up.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    return up.status_code, None
            status = up.status_code
        try:
            return status, orjson.loads(bytes(body))
        except orjson.JSONDecodeError:
            return status, None

    async def get_json(self, path: str, client_headers: Mapping[str, str], max_bytes: int = 1 << 20
                       ) -> tuple[int, Any]:
        """A GET of a small JSON document (``/v1/models``) with the client's or the upstream key: ``(status, parsed
        JSON)``, None for a body that is not JSON or is larger than ``max_bytes``."""
        try:
            return await self._small_json(path, self.auth_headers(client_headers), max_bytes)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc) from exc

    async def health_status(self, timeout: float) -> int | str:
        """vLLM's ``GET /health`` (with the upstream key): its status, or why there is none (a sentence)."""
        try:
            async with asyncio.timeout(timeout):  # covers a server that accepts but never answers
                response = await self.http.get("/health", headers=self.auth_headers({}), timeout=timeout)
        except (TimeoutError, httpx.TimeoutException):
            return f"upstream /health did not answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return f"upstream unreachable ({type(exc).__name__})"
        return response.status_code

    async def probe_json(self, path: str, timeout: float, max_bytes: int = 1 << 16) -> tuple[int, Any] | str:
        """A small ``GET`` (with the upstream key), e.g. vLLM's ``/version``: status and parsed JSON (None when the
        body is not JSON or larger than ``max_bytes``), or why there is none (a sentence)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._small_json(path, self.auth_headers({}), max_bytes, timeout)
        except (TimeoutError, httpx.TimeoutException):
            return f"upstream {path} did not answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return f"upstream unreachable ({type(exc).__name__})"

    async def fetch_metrics(self, timeout: float, max_bytes: int) -> tuple[int, bytes, str] | GatewayError:
        """vLLM's ``GET /metrics`` (with the upstream key): status, body, content type — or the error it maps to."""
        try:
            async with asyncio.timeout(timeout):
                async with self.http.stream("GET", "/metrics", headers=self.auth_headers({}), timeout=timeout) as up:
                    body = bytearray()
                    async for chunk in up.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            return UpstreamUnavailable(f"The upstream's metrics exceed {max_bytes} bytes.")
                    return up.status_code, bytes(body), up.headers.get("content-type", "")
        except TimeoutError:
            return UpstreamTimeout(f"The upstream's metrics did not come within {timeout:g} s.")
        except httpx.HTTPError as exc:
            return map_transport_error(exc)

    def proxy_path(self, raw_path: bytes) -> str | None:
        """The allow-listed upstream path a pass-through request names, or None. The raw path (before any
        percent-decoding) must equal an entry of ``--proxy-paths``: a dot segment, a doubled or trailing slash
        or an encoded character is no match, so what goes upstream is exactly an entry of the list."""
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            return None
        return path if path in self._proxy_paths else None

    async def proxy(self, method: str, path: str, query: str, headers: Mapping[str, str],
                    body: AsyncIterator[bytes] | bytes | None) -> UpstreamResponse:
        """Forward a request to an allow-listed path (``proxy_path``). The answer streams back; the client's
        body is read first (it is bounded by the caller's limit, which raises past it), then sent whole."""
        if body is not None and not isinstance(body, bytes):
            body = b"".join([chunk async for chunk in body])
        fwd = {k: v for k, v in headers.items() if k.lower() not in PROXY_DROP_REQUEST}
        fwd.update(self.auth_headers(headers))
        url = httpx.URL(path, query=query.encode() if query else b"")
        request = self.http.build_request(method, url, headers=fwd, content=body)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc) from exc
        return UpstreamResponse(response)
