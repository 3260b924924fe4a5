"""The key material behind reasoning ``encrypted_content`` and MCP approval ids, the same in every process.

``--reasoning-key`` when it is set. Otherwise the store's own key (``ResponseStore.key_material``: a 0600 file
beside the SQLite database, a row in PostgreSQL), made by the first gateway that asks: every worker, every
restart and every replica sharing the store seals and opens with it. With ``--store none`` nothing outlives the
start: the parent of ``--workers N`` generates one key for its workers (gateway.server.workers), a single process
generates its own, and blobs sealed before a restart no longer open (they are dropped and counted).
"""

from __future__ import annotations

import base64
import os

import structlog

from gateway.config import Settings
from gateway.store import ResponseStore

log = structlog.get_logger("gateway.keys")

__all__ = ["new_key", "with_reasoning_key"]


def new_key() -> str:
    """A fresh key in ``--reasoning-key``'s form (base64 of 32 random bytes)."""
    return base64.b64encode(os.urandom(32)).decode()


async def with_reasoning_key(settings: Settings, store: ResponseStore | None) -> Settings:
    """``settings`` with ``reasoning_key`` resolved as above (what the responses handler and its tool loop use)."""
    if settings.reasoning_key:
        return settings
    material: bytes | None = None
    if store is not None:
        try:
            material = await store.key_material()
        except NotImplementedError:
            material = None
    if material is None:
        log.warning("reasoning_key_per_start", message="No --reasoning-key and no store to keep one: reasoning "
                    "encrypted_content and MCP approval ids do not survive a restart nor open on another replica. "
                    "Set GATEWAY_REASONING_KEY.")
        return settings.with_overrides(reasoning_key=new_key())
    return settings.with_overrides(reasoning_key=base64.b64encode(material).decode())
