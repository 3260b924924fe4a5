"""``Host`` and ``Origin`` checks, before anything else runs (the outermost ASGI middleware).

Why: a gateway without API keys on a developer's machine is reachable by every web page its browser opens. A
page can send it ``text/plain`` POSTs and open WebSockets (browsers do not apply CORS to either), and a DNS
rebinding page (``evil.example`` re-resolved to 127.0.0.1) can even read its answers. The ``Host`` check stops
rebinding (the browser sends the attacker's name); the ``Origin`` check stops cross-site requests and WebSocket
handshakes (browsers always send ``Origin`` on those; SDKs and curl send none, and pass).

Rules:

- ``Host``: entries of ``--allowed-hosts`` are ``*``, a host name (any port) or ``host:port`` (that port only),
  compared case-insensitively; IPv6 addresses with or without brackets. A missing or unlisted ``Host`` is 403
  ``host_not_allowed``. ``/healthz``, ``/readyz`` and ``/metrics`` are exempt: Kubernetes probes and scrapers
  name the pod IP, which no list can know in advance.
- ``Origin``: a request or WebSocket handshake carrying an ``Origin`` not in ``--allowed-origins`` (``*`` = any)
  is 403 ``origin_not_allowed``; requests without one pass.

Both answers are OpenAI-shaped; a refused WebSocket handshake is the same HTTP 403 (the denial-response
extension), or a plain 403 from the server where it lacks that extension.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.server.http import error_response

log = structlog.get_logger("gateway.guard")

__all__ = ["EXEMPT_PATHS", "HostOriginGuard", "HostRule", "origin_allowed"]

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


def _split_host(value: str) -> tuple[str, str | None]:
    """``(host, port)`` of a Host header or an allow-list entry, lower-cased, IPv6 without brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        end = value.find("]")
        if end < 0:
            return value, None
        host, rest = value[1:end], value[end + 1:]
        return host, rest[1:] if rest.startswith(":") and rest[1:] else None
    if value.count(":") > 1:  # a bare IPv6 address (allow-list entries may be written so): no port
        return value, None
    host, sep, port = value.partition(":")
    return host, port if sep and port else None


class HostRule:
    """``--allowed-hosts`` compiled: ``*`` (anything), or host names with an optional port."""

    def __init__(self, entries: Iterable[str]) -> None:
        entries = [e.strip() for e in entries if e.strip()]
        self.any = "*" in entries
        self.names: set[str] = set()  # any port
        self.pairs: set[tuple[str, str]] = set()  # this port only
        for entry in entries:
            if entry == "*":
                continue
            host, port = _split_host(entry)
            if port is None:
                self.names.add(host)
            else:
                self.pairs.add((host, port))

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False
        host, port = _split_host(header)
        return host in self.names or (port is not None and (host, port) in self.pairs)


def origin_allowed(origin: str, allowed: Iterable[str]) -> bool:
    """An ``Origin`` (``scheme://host[:port]``) against ``--allowed-origins``; scheme and host are
    case-insensitive, a trailing slash in an entry is forgiven."""
    given = origin.strip().rstrip("/").lower()
    for entry in allowed:
        entry = entry.strip().rstrip("/").lower()
        if entry == "*" or entry == given:
            return True
    return False


class HostOriginGuard:
    """Pure ASGI middleware: refuses (403) what fails the ``Host`` or ``Origin`` rule, for HTTP and WebSocket
    handshakes alike; ``on_refused(reason)`` counts each refusal (``host`` or ``origin``)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str], allowed_origins: Iterable[str],
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.hosts = HostRule(allowed_hosts)
        self.origins = tuple(o for o in allowed_origins if o.strip())
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host: str | None = None
        origin: str | None = None
        for key, value in scope.get("headers") or ():
            name = key.lower()
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        exc: Forbidden | None = None
        if scope.get("path") not in EXEMPT_PATHS and not self.hosts.allows(host):
            exc = Forbidden("This gateway does not answer requests for this Host; list it in --allowed-hosts "
                            "(GATEWAY_ALLOWED_HOSTS).", code="host_not_allowed")
        elif origin is not None and not origin_allowed(origin, self.origins):
            exc = Forbidden("Requests from this Origin are not allowed; list it in --allowed-origins "
                            "(GATEWAY_ALLOWED_ORIGINS).", code="origin_not_allowed")
        if exc is None:
            await self.app(scope, receive, send)
            return
        reason = "host" if exc.code == "host_not_allowed" else "origin"
        # Neither value (nor the path) is logged: all are client-chosen strings.
        log.info("request_refused", reason=reason, websocket=scope["type"] == "websocket")
        if self.on_refused is not None:
            self.on_refused(reason)
        response = error_response(exc, headers={"connection": "close"} if scope["type"] == "http" else None)
        if scope["type"] == "websocket":
            if "websocket.http.response" in (scope.get("extensions") or {}):
                await response(scope, receive, send)  # starlette sends it as websocket.http.response.*
            else:  # closing before accepting: the server answers the handshake with a bare 403
                await send({"type": "websocket.close", "code": 1008})
            return
        await response(scope, receive, send)
