"""TTL retention: periodically delete stored responses older than the configured time to live, and
conversations neither created nor changed within it (see ResponseStore.sweep)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.store.base import ResponseStore

log = logging.getLogger(__name__)


async def run_sweeper(
    store: ResponseStore,
    ttl_seconds: int,
    interval: float,
    now: Callable[[], float] = time.time,
) -> None:
    """Sweep records with created_at older than now() - ttl_seconds, then every `interval` seconds.

    Runs until cancelled (run it as a task; cancel it at shutdown). A failed sweep is logged and
    retried at the next interval: a database blip must not end retention for the process's lifetime.
    """
    if ttl_seconds < 0:
        raise ValueError("ttl_seconds must not be negative")
    if interval <= 0:
        raise ValueError("interval must be positive")
    while True:
        cutoff = int(now() - ttl_seconds)
        try:
            deleted = await store.sweep(cutoff)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("response store sweep failed (cutoff=%d); retrying in %.1fs", cutoff, interval)
        else:
            if deleted:
                log.info("response store sweep deleted %d responses and conversations older than %d", deleted,
                         cutoff)
        await asyncio.sleep(interval)
