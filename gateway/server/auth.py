"""Optional gateway API keys.

Keys are compared with ``hmac.compare_digest`` against *every* configured key, without stopping at the first
match, so the time taken says nothing about which key (or which prefix) matched.

Credential forwarding: when gateway keys are configured, the client's ``Authorization`` carries the gateway
key, which is not the upstream's business; ``GatewayAuthMiddleware`` removes it before routing, so the
upstream sees ``GATEWAY_UPSTREAM_API_KEY`` when that is set and no credential otherwise. Without gateway keys
the client's ``Authorization`` passes through unchanged (vLLM may check it itself).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized

__all__ = ["OPEN_PATHS", "ApiKeyAuth", "GatewayAuthMiddleware", "unauthorized", "verdict"]

# Probes and scrapers carry no credentials; everything else (all of /v1/* and the pass-through proxy)
# needs a key when keys are configured.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/upstream/metrics"})
SCOPE_KEY = "gateway.authorized"


def _bearer(value: bytes | None) -> bytes | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyAuth:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode("utf-8") for k in keys if k)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def verify(self, authorization: bytes | None) -> bool:
        token = _bearer(authorization)
        if token is None:
            return False
        matched = False
        for key in self._keys:  # no early exit: every key is compared
            matched |= hmac.compare_digest(token, key)
        return matched


def unauthorized(presented: bool) -> Unauthorized:
    # The presented key is never echoed (OpenAI echoes a masked prefix; a gateway has no reason to).
    if presented:
        return Unauthorized("Incorrect API key provided.", headers={"www-authenticate": "Bearer"})
    return Unauthorized("You didn't provide an API key. You need to provide your API key in an Authorization "
                        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                        headers={"www-authenticate": "Bearer"})


class GatewayAuthMiddleware:
    """Checks the key once, before routing, records the verdict in the scope and strips the credential.

    The 401 itself is raised by the route wrapper, so it is logged and counted under its route like any
    other answer.
    """

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth, *, strip: bool) -> None:
        self.app = app
        self.auth = auth
        self.strip = strip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.auth.enabled:
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or ())
        authorization = next((v for k, v in headers if k.lower() == b"authorization"), None)
        scope = dict(scope)
        scope[SCOPE_KEY] = (self.auth.verify(authorization), authorization is not None)
        if self.strip:
            scope["headers"] = [(k, v) for k, v in headers if k.lower() != b"authorization"]
        await self.app(scope, receive, send)


def verdict(scope: Scope) -> tuple[bool, bool]:
    """``(authorized, presented)`` as the middleware found them; unauthorized (fail closed) when the
    middleware did not run."""
    return scope.get(SCOPE_KEY, (False, False))
