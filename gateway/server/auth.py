"""Optional gateway API keys.

Keys are compared with ``hmac.compare_digest`` against *every* configured key, without stopping at the first
match, so the time taken says nothing about which key (or which prefix) matched.

Credential forwarding: when gateway keys are configured, the client's ``Authorization`` carries the gateway
key, which is not the upstream's business; ``GatewayAuthMiddleware`` removes it before routing, so the
upstream sees ``GATEWAY_UPSTREAM_API_KEY`` when that is set and no credential otherwise. Without gateway keys
the client's ``Authorization`` passes through unchanged (vLLM may check it itself).

Ownership: an authenticated request carries its *owner* in the scope (``request_owner``): the hex
HMAC-SHA256 of the presented key under the deployment's owner secret (``GATEWAY_OWNER_SECRET``, or, when
that is unset, a secret derived from the configured key set: then adding or removing a key changes every
owner). The store records it on responses, their items and conversations, and filters by it; the key itself
is never stored. Without gateway keys there is no owner (None): single-tenant, everything visible.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized

__all__ = ["OPEN_PATHS", "ApiKeyAuth", "GatewayAuthMiddleware", "request_owner", "unauthorized", "verdict"]

# Probes and scrapers carry no credentials; everything else (all of /v1/* and the pass-through proxy)
# needs a key when keys are configured.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
SCOPE_KEY = "gateway.authorized"
OWNER_KEY = "gateway.owner"


def _bearer(value: bytes | None) -> bytes | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyAuth:
    def __init__(self, keys: Iterable[str], owner_secret: str | None = None) -> None:
        self._keys = tuple(k.encode("utf-8") for k in keys if k)
        if owner_secret:
            self._owner_secret = owner_secret.encode("utf-8")
        else:  # stable for a given key set, whatever its order or repetitions
            material = b"\0".join(sorted(set(self._keys)))
            self._owner_secret = hashlib.sha256(b"responses-gateway owner secret v1\0" + material).digest()

    def owner(self, key: bytes) -> str:
        """The owner recorded for objects created with this (verified) key: a keyed hash, never the key."""
        return hmac.new(self._owner_secret, key, hashlib.sha256).hexdigest()

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
        if scope["type"] not in ("http", "websocket") or not self.auth.enabled:  # a WebSocket: its handshake
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or ())
        authorization = next((v for k, v in headers if k.lower() == b"authorization"), None)
        scope = dict(scope)
        authorized = self.auth.verify(authorization)
        scope[SCOPE_KEY] = (authorized, authorization is not None)
        token = _bearer(authorization) if authorized else None
        if token is not None:
            scope[OWNER_KEY] = self.auth.owner(token)
        if self.strip:
            scope["headers"] = [(k, v) for k, v in headers if k.lower() != b"authorization"]
        await self.app(scope, receive, send)


def verdict(scope: Scope) -> tuple[bool, bool]:
    """``(authorized, presented)`` as the middleware found them; unauthorized (fail closed) when the
    middleware did not run."""
    return scope.get(SCOPE_KEY, (False, False))


def request_owner(scope: Scope) -> str | None:
    """The authenticated caller's owner hash; None without gateway keys (single-tenant)."""
    owner = scope.get(OWNER_KEY)
    return owner if isinstance(owner, str) else None
