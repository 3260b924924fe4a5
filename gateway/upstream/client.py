"""HTTP client for the upstream (vLLM). Maps transport failures to the gateway's errors in one place.

httpx is the client API. Model requests (``send_json``: every response's one or two POSTs) run on the lean
HTTP/1.1 transport in ``gateway.upstream.h1`` (httptools' C parser on a bare asyncio protocol); everything
else (the pass-through proxy, readiness, metrics) runs on aiohttp (``httpx-aiohttp``'s transport, see
``AiohttpUpstreamTransport``), whose HTTP/1.1 parser is C too. httpcore's pure-Python h11 path and anyio
streams cost several times more per upstream frame. Connections are kept alive and reused: a stream that
ended on its own terminal event is ``release()``d (the rest of its body read, bounded) rather than dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamTimeout, UpstreamUnavailable, normalize_upstream_error
from gateway.upstream.h1 import DIRECT_BODY as _BODY
from gateway.upstream.h1 import H1Transport

__all__ = ["AiohttpUpstreamTransport", "UpstreamClient", "UpstreamResponse", "map_transport_error"]

# release(): how much of a finished stream's remaining body is read to keep its connection, and for how long.
RELEASE_MAX_BYTES = 64 * 1024
RELEASE_TIMEOUT = 1.0
# Idle upstream connections are closed after this long: below uvicorn's (vLLM's) 5 s keep-alive timeout, so
# the gateway never sends a request on a connection the server is closing at that very moment.
KEEPALIVE_EXPIRY = 3.0
# One read hands over everything the socket has buffered, up to this much (one read may carry many frames).
READ_SIZE = 1 << 20

# Headers never forwarded between hops (RFC 9110 §7.6.1) plus ones httpx/uvicorn recompute.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})


def map_transport_error(exc: httpx.HTTPError) -> GatewayError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"The upstream did not answer in time ({type(exc).__name__}).")
    return UpstreamUnavailable(f"The upstream could not be reached ({type(exc).__name__}).")


def _httpx_error(exc: BaseException, request: httpx.Request | None = None) -> httpx.TransportError:
    """An aiohttp failure as the httpx exception httpcore would have raised.

    (httpx-aiohttp's own table maps every ``ClientConnectionError`` to ``ConnectTimeout``: a refused
    connection or a server closing a kept-alive connection would read as a timeout.)
    """
    cls: type[httpx.TransportError]
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        cls = httpx.ConnectTimeout
    elif isinstance(exc, TimeoutError):  # SocketTimeoutError, ServerTimeoutError: no bytes for too long
        cls = httpx.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        cls = httpx.ConnectError
    elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        cls = httpx.RemoteProtocolError
    elif isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        cls = httpx.UnsupportedProtocol
    else:
        cls = httpx.ReadError
    return cls(str(exc) or type(exc).__name__, request=request)


class _BodyStream(httpx.AsyncByteStream):
    """An aiohttp response body for httpx: each read hands over all the socket has buffered (``READ_SIZE``).

    Closing it returns the connection to the pool when the whole body has arrived, and closes (drops) the
    connection otherwise — which is what aborts the upstream request.
    """

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = self._resp.content.read
        try:
            while True:
                chunk = await read(READ_SIZE)
                if not chunk:
                    return
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _httpx_error(exc) from exc

    async def aclose(self) -> None:
        resp = self._resp
        if resp.content.is_eof():
            resp.release()
        else:
            resp.close()


class _WatchedBody(httpx.AsyncByteStream):
    """A streamed request body that remembers the exception its source raised."""

    def __init__(self, source: Any, failed: list[Exception]) -> None:
        self._source = source
        self._failed = failed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._source:
                yield chunk
        except Exception as exc:
            self._failed.append(exc)
            raise


class AiohttpUpstreamTransport(AiohttpTransport):
    """httpx-aiohttp's transport with this gateway's session, body stream and exception mapping.

    The session has no cookie jar (httpx keeps cookies, if anyone wants them) and does not decompress
    (httpx decodes ``content-encoding`` as with its own transport). Limits and keep-alive come from
    ``httpx.Limits``; timeouts from each request's ``httpx.Timeout`` (connect, read = idle time between
    reads, pool = waiting for a free connection).
    """

    def __init__(self, *, limits: httpx.Limits, verify: bool = True) -> None:
        self._connector_limits = limits
        super().__init__(verify=verify, limits=limits, client=self._session)

    def _session(self) -> aiohttp.ClientSession:
        limits = self._connector_limits
        connector = aiohttp.TCPConnector(limit=limits.max_connections or 0,
                                         keepalive_timeout=limits.keepalive_expiry or KEEPALIVE_EXPIRY,
                                         ssl=self.ssl_context)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                     auto_decompress=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        failed: list[Exception] = []
        try:
            request.content  # noqa: B018 (a streamed body raises RequestNotRead)
        except httpx.RequestNotRead:
            # aiohttp sends a streamed body from a task of its own and reports its failure as a connection
            # error; the body's own exception (e.g. the gateway's 413 past the body limit) is what counts.
            request.stream = _WatchedBody(request.stream, failed)  # type: ignore[arg-type]
        try:
            response = await super().handle_async_request(request)
        except httpx.TransportError as exc:
            if failed:
                raise failed[0] from None
            cause = exc.__cause__
            raise (_httpx_error(cause, request) if cause is not None else exc) from cause
        except (TimeoutError, aiohttp.ClientError) as exc:
            if failed:
                raise failed[0] from None
            raise _httpx_error(exc, request) from exc
        resp = getattr(response.stream, "_aiohttp_response", None)
        if resp is not None:
            body = response.stream = _BodyStream(resp)
            response.extensions[_BODY] = body  # httpx's client wraps the stream; UpstreamResponse reads this one
        return response


def default_transport(settings: Settings, limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """The transport to the real upstream (tests and the demo pass their own)."""
    # Certificates are only loaded for an https upstream (the CA bundle costs memory in every process).
    return AiohttpUpstreamTransport(limits=limits, verify=settings.upstream_url.startswith("https://"))


@dataclass(slots=True)
class UpstreamResponse:
    """An open upstream response. ``release`` or ``aclose`` must always run; the server does it in ``finally``.

    ``aclose`` aborts (a client that left, a gateway-side failure: the connection is dropped unless the
    body had already arrived whole, so vLLM stops generating); ``release`` ends a response that is complete
    (its terminal event seen) by reading what is left of the body, bounded, so the connection is reused.
    """

    response: httpx.Response
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
        stopped. On the aiohttp transport an identity-encoded body is read from the socket buffer directly,
        each chunk being all that had arrived."""
        body = self._body
        if body is None:
            response = self.response
            stream = response.extensions.get(_BODY)
            if isinstance(stream, httpx.AsyncByteStream) and "content-encoding" not in response.headers \
                    and not response.is_stream_consumed:
                response.is_stream_consumed = True
                body = stream.__aiter__()
            else:
                body = response.aiter_bytes()
            self._body = body
        return body

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
    _NO_COOKIES = _NoCookies()

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        return self._NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        pass


class UpstreamClient:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        limits = httpx.Limits(max_connections=settings.max_concurrency + 16,
                              max_keepalive_connections=settings.max_concurrency, keepalive_expiry=KEEPALIVE_EXPIRY)
        self._timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
        self._stream_timeout = httpx.Timeout(settings.stream_idle_timeout, connect=settings.connect_timeout)
        self._timeouts = {True: self._stream_timeout.as_dict(), False: self._timeout.as_dict()}
        self._urls: dict[str, httpx.URL] = {}
        self._transport = transport if transport is not None else default_transport(settings, limits)
        self.http = _Client(base_url=settings.upstream_url.rstrip("/"), transport=self._transport,
                            limits=limits, timeout=self._timeout)
        # Model requests (send_json) go over the lean HTTP/1.1 transport (gateway.upstream.h1); everything else
        # (the pass-through proxy, readiness, metrics) over aiohttp. A transport passed in serves both.
        self._model_transport: httpx.AsyncBaseTransport = transport if transport is not None else H1Transport(
            limits=limits)
        self._routes: dict[str, tuple[httpx.URL, httpx.AsyncBaseTransport]] = {}

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._model_transport is not self._transport:
            await self._model_transport.aclose()

    def _url(self, path: str) -> httpx.URL:
        """The absolute URL of an upstream path, parsed once (httpx parses a relative one on every request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.http.base_url.join(path.lstrip("/"))
        return url

    def _route(self, path: str) -> tuple[httpx.URL, httpx.AsyncBaseTransport]:
        """A model path's URL and transport: a proxy the environment configures for it (httpx's mounts,
        ``HTTPS_PROXY`` and friends) is kept; otherwise the model transport."""
        route = self._routes.get(path)
        if route is None:
            url = self._url(path)
            mounted = self.http._transport_for_url(url)  # httpx-private, once per path
            route = self._routes[path] = (url, self._model_transport if mounted is self._transport else mounted)
        return route

    def auth_headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        if self.settings.upstream_api_key:
            return {"authorization": f"Bearer {self.settings.upstream_api_key}"}
        auth = client_headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def send_json(self, path: str, body: Mapping[str, Any], client_headers: Mapping[str, str], *,
                        stream: bool, extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST a JSON body; the response is returned open (streamed) so the caller decides how to read it.

        For streams the read timeout is the idle timeout: no upstream bytes for that long raises
        ``httpx.ReadTimeout`` inside the stream, which the pump turns into ``response.failed``.
        """
        headers = {"content-type": "application/json", "accept": "text/event-stream" if stream else
                   "application/json", **self.auth_headers(client_headers), **(extra_headers or {})}
        # Straight to the transport: every model request takes this path (two per response under constrain),
        # and httpx's client layers around the transport (default-header and cookie merging, auth and
        # redirect loops, the bound stream, a log line per request) cost about as much CPU as the aiohttp
        # request itself (bench/README.md). The request and response are still httpx's own objects.
        url, transport = self._route(path)
        request = httpx.Request("POST", url, content=orjson.dumps(body), headers=headers,
                                extensions={"timeout": self._timeouts[stream]})
        try:
            response = await transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc) from exc
        response.request = request
        return UpstreamResponse(response)

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

    async def proxy(self, method: str, path: str, query: str, headers: Mapping[str, str],
                    body: AsyncIterator[bytes] | bytes | None) -> UpstreamResponse:
        """Forward any other request unchanged; the body streams both ways."""
        fwd = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "authorization"}
        fwd.update(self.auth_headers(headers))
        url = httpx.URL(path, query=query.encode() if query else b"")
        request = self.http.build_request(method, url, headers=fwd, content=body)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc) from exc
        return UpstreamResponse(response)
