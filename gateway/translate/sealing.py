"""Reasoning that survives ``store: false``: the gateway's own ``encrypted_content`` for reasoning items.

Codex sends every turn with ``store: false`` and ``include: ["reasoning.encrypted_content"]`` and replays the
reasoning items of earlier turns; that is how a reasoning model keeps its chain of thought across tool calls.
vLLM refuses ``encrypted_content`` (400), and has no blob of its own to offer. So the gateway seals each
reasoning item's text (and the upstream item's id) with AES-256-GCM under ``--reasoning-key`` and hands the
client that blob as ``encrypted_content``; when the item comes back, the blob is opened and vLLM gets the
reasoning item with its text (the form it accepts), never the blob.

Blob: ``base64url(0x01 | key id (4 bytes) | nonce (12 bytes) | AES-GCM(ciphertext + tag))``; the plaintext is
JSON ``{"id", "text"}``; the associated data binds the format version and the owner (the keyed hash of the
gateway API key the blob was sealed for), so a blob handed to another key holder does not open for them. A blob
that does not open (another deployment's key, another owner's, tampered, truncated) opens to None: the caller
drops it and counts it, so a key rotation never breaks a running session. Several keys may be configured: the
first seals, all open. A ``purpose`` other than reasoning (``compaction``: a compaction item's summary,
gateway.engine.compaction) goes into the associated data too, so a blob sealed for one use never opens as the
other. Without gateway keys (owner None) the associated data is the version's alone, as it was
before owners were bound: blobs sealed then still open on keyless gateways, and never for an owner.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.protocol.ids import RandomBytes

__all__ = ["ReasoningSealer", "open_sealed_reasoning", "parse_keys", "reasoning_text"]

_VERSION = b"\x01"
_AAD = b"responses-gateway/reasoning/v1"
_NONCE = 12


def parse_keys(value: str | Sequence[str]) -> list[bytes]:
    """``--reasoning-key``: base64 (standard or url-safe) keys of 32 bytes, comma-separated. ValueError otherwise."""
    texts = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    keys = []
    for text in texts:
        try:
            raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if ("-" in text or "_" in text)
                                   else None, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("a --reasoning-key is not valid base64") from exc
        if len(raw) != 32:
            raise ValueError(f"a --reasoning-key must decode to 32 bytes (AES-256), not {len(raw)}")
        keys.append(raw)
    return keys


def _aad(owner: str | None, purpose: str = "reasoning") -> bytes:
    base = _AAD if purpose == "reasoning" else b"responses-gateway/" + purpose.encode() + b"/v1"
    return base if owner is None else base + b"/owner:" + owner.encode()


def reasoning_text(item: Mapping[str, Any]) -> str:
    """The reasoning's text: its ``content`` parts, else its summary."""
    parts = item.get("content")
    if isinstance(parts, list):
        text = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        if text:
            return text
    summary = item.get("summary")
    return "".join(str(s.get("text", "")) for s in summary or () if isinstance(s, dict)) if isinstance(
        summary, list) else ""


class ReasoningSealer:
    def __init__(self, keys: Sequence[bytes], *, random_bytes: RandomBytes) -> None:
        """``keys``: the first seals, all open; ``random_bytes``: the nonces' source (``os.urandom``)."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if not keys:
            raise ValueError("ReasoningSealer needs at least one key")
        self._ciphers = [(hashlib.sha256(k).digest()[:4], AESGCM(bytes(k))) for k in keys]
        self._random = random_bytes
        self.rejected = 0

    def seal(self, item: Mapping[str, Any], owner: str | None = None, *, purpose: str = "reasoning") -> str:
        """The blob of ``item``, opening only for ``owner`` (None: a gateway without API keys) and ``purpose``."""
        key_id, cipher = self._ciphers[0]
        nonce = self._random(_NONCE)
        plain = orjson.dumps({"id": item.get("id"), "text": reasoning_text(item)})
        blob = _VERSION + key_id + nonce + cipher.encrypt(nonce, plain, _aad(owner, purpose))
        return base64.urlsafe_b64encode(blob).decode().rstrip("=")

    def open(self, blob: Any, owner: str | None = None, *, purpose: str = "reasoning") -> dict[str, Any] | None:
        """The sealed ``{"id", "text"}``, or None when the blob does not open (with any configured key) for
        ``owner``."""
        from cryptography.exceptions import InvalidTag

        if not isinstance(blob, str) or not blob:
            return None
        try:
            raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
        except (binascii.Error, ValueError):
            return None
        if len(raw) < 1 + 4 + _NONCE + 16 or raw[:1] != _VERSION:
            return None
        key_id, nonce, sealed = raw[1:5], raw[5:5 + _NONCE], raw[5 + _NONCE:]
        aad = _aad(owner, purpose)
        # The key named by the blob first, then the others (a key id collision costs one more try).
        for _kid, cipher in sorted(self._ciphers, key=lambda c: c[0] != key_id):
            try:
                plain = cipher.decrypt(nonce, sealed, aad)
            except InvalidTag:
                continue
            try:
                value = orjson.loads(plain)
            except orjson.JSONDecodeError:
                return None
            return value if isinstance(value, dict) and isinstance(value.get("text"), str) else None
        return None


def open_sealed_reasoning(items: Sequence[Any], sealer: ReasoningSealer | None,
                          owner: str | None = None) -> tuple[list[Any], int]:
    """Input items with every sealed reasoning item opened into the form vLLM accepts (its text as
    ``reasoning_text`` content, no ``encrypted_content``); how many blobs did not open for ``owner`` (those are
    dropped, and their item too when it carries no readable text of its own)."""
    out: list[Any] = []
    rejected = 0
    for item in items:
        if not (isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content")):
            out.append(item)
            continue
        opened = sealer.open(item["encrypted_content"], owner) if sealer is not None else None
        rest = {k: v for k, v in item.items() if k != "encrypted_content"}
        if opened is None:
            rejected += 1
            if reasoning_text(rest):
                out.append(rest)
            continue
        rest["content"] = [{"type": "reasoning_text", "text": opened["text"]}]
        rest.setdefault("summary", [])
        out.append(rest)
    return out, rejected
