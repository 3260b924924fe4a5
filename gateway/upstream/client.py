"""HTTP client for the upstream (vLLM). Maps transport failures to the gateway's errors in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamTimeout, UpstreamUnavailable, normalize_upstream_error

__all__ = ["UpstreamClient", "UpstreamResponse", "map_transport_error"]

# Headers never forwarded between hops (RFC 9110 §7.6.1) plus ones httpx/uvicorn recompute.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})


def map_transport_error(exc: httpx.HTTPError) -> GatewayError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"The upstream did not answer in time ({type(exc).__name__}).")
    return UpstreamUnavailable(f"The upstream could not be reached ({type(exc).__name__}).")


@dataclass(slots=True)
class UpstreamResponse:
    """An open upstream response. ``aclose`` must always run; the server does it in ``finally``."""

    response: httpx.Response

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def ok(self) -> bool:
        return 200 <= self.response.status_code < 300

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self.response.aiter_raw()

    async def error_body(self, limit: int = 1 << 20) -> dict[str, Any]:
        """The upstream's error, normalized to OpenAI's shape (reading at most ``limit`` bytes)."""
        buf = bytearray()
        try:
            async for chunk in self.response.aiter_bytes():
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
        await self.response.aclose()


class UpstreamClient:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        limits = httpx.Limits(max_connections=settings.max_concurrency + 16,
                              max_keepalive_connections=settings.max_concurrency)
        self._timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
        self._stream_timeout = httpx.Timeout(settings.stream_idle_timeout, connect=settings.connect_timeout)
        self.http = httpx.AsyncClient(base_url=settings.upstream_url.rstrip("/"), transport=transport,
                                      limits=limits, timeout=self._timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

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
        request = self.http.build_request("POST", path, content=orjson.dumps(body), headers=headers,
                                          timeout=self._stream_timeout if stream else self._timeout)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc) from exc
        return UpstreamResponse(response)

    async def post_json(self, path: str, body: Mapping[str, Any], client_headers: Mapping[str, str]
                        ) -> tuple[int, Any]:
        """A non-streamed POST: ``(status, parsed JSON or error body)``."""
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
