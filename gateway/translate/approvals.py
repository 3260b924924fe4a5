"""Verifiable ``mcp_approval_request`` ids: an approval runs a call only if this gateway asked for it.

An ``mcp_approval_response`` names the request it answers by id. With a stored chain the request is in the
gateway's store; with ``store: false`` the client sends the request back itself, so its fields (server, tool,
arguments) are the client's word. The id therefore carries a MAC over everything the call depends on — the owner
(``gateway.server.auth.request_owner``), the server's identity, the tool name and the exact arguments string —
and an expiry, under a key derived (HKDF-SHA256, an info string of its own) from ``--reasoning-key``: the same key
material every process and replica shares, never used for two purposes. The first key mints; every configured
key verifies (rotation).

Id: ``mcpr_`` + hex(version (1) | expiry, unix seconds (4) | nonce (8) | HMAC-SHA256 truncated to 16 bytes): a
plain string of 63 characters, as the SDKs expect. ``ApprovalSigner`` keeps a bounded record of the ids whose
call already ran in this process (until their expiry), so an approval is not replayed. Pure apart from the
clock and the random source, which are injected.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import sha256

import orjson
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.protocol.ids import Clock, RandomBytes

__all__ = ["APPROVAL_TTL", "ApprovalSigner"]

APPROVAL_TTL = 3600.0  # a store: false client answers within the hour; a stored chain has no expiry
MAX_SPENT = 65536  # ids remembered as run (each until its expiry); past this the soonest to expire go first
_PREFIX = "mcpr_"
_VERSION = 1
_TAG = 16
_INFO = b"responses-gateway/mcp-approval-request/v1"


def _derive(key: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(key)


class ApprovalSigner:
    def __init__(self, keys: Sequence[bytes], *, random_bytes: RandomBytes, clock: Clock,
                 ttl: float = APPROVAL_TTL) -> None:
        if not keys:
            raise ValueError("ApprovalSigner needs at least one key")
        self._keys = [_derive(bytes(k)) for k in keys]
        self._random = random_bytes
        self._clock = clock
        self._ttl = ttl
        self._spent: OrderedDict[str, float] = OrderedDict()  # id → its expiry

    def _tag(self, key: bytes, head: bytes, owner: str | None, server: str, name: str, arguments: str) -> bytes:
        material = orjson.dumps([owner or "", server, name, arguments])
        return hmac.new(key, head + material, sha256).digest()[:_TAG]

    def mint(self, owner: str | None, server: str, name: str, arguments: str) -> str:
        """The id of an approval request the gateway issues now to ``owner``."""
        expiry = int(self._clock() + self._ttl)
        head = bytes([_VERSION]) + expiry.to_bytes(4, "big") + self._random(8)
        return _PREFIX + (head + self._tag(self._keys[0], head, owner, server, name, arguments)).hex()

    def verify(self, request_id: object, owner: str | None, server: str, name: str, arguments: str, *,
               check_expiry: bool = True) -> str | None:
        """None when this gateway minted ``request_id`` for exactly these fields (and, with ``check_expiry``, it
        has not expired), else why not (fit for the caller)."""
        if not isinstance(request_id, str) or not request_id.startswith(_PREFIX):
            return "it was not issued by this gateway"
        try:
            raw = bytes.fromhex(request_id[len(_PREFIX):])
        except ValueError:
            return "it was not issued by this gateway"
        if len(raw) != 13 + _TAG or raw[0] != _VERSION:
            return "it was not issued by this gateway"
        head, tag = raw[:13], raw[13:]
        if not any(hmac.compare_digest(self._tag(k, head, owner, server, name, arguments), tag) for k in self._keys):
            return "it was not issued by this gateway for this caller, server, tool and arguments"
        if check_expiry and int.from_bytes(head[1:5], "big") < self._clock():
            return "it has expired; ask the model again"
        return None

    def spend(self, request_id: str) -> bool:
        """Record that ``request_id``'s call runs now; False when it already ran (in this process)."""
        now = self._clock()
        while self._spent and (len(self._spent) >= MAX_SPENT or next(iter(self._spent.values())) < now):
            self._spent.popitem(last=False)
        if request_id in self._spent:
            return False
        raw = bytes.fromhex(request_id[len(_PREFIX):]) if request_id.startswith(_PREFIX) else b""
        expiry = float(int.from_bytes(raw[1:5], "big")) if len(raw) > 5 else now + self._ttl
        self._spent[request_id] = max(expiry, now + self._ttl)
        return True
