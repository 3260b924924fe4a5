"""Public item ids, and the types through which the pure core is handed its clock, ids and randomness.

``protocol/`` and ``translate/`` keep no time and draw no randomness themselves (an import contract in
``.importlinter`` holds them to it): whatever needs a fresh id, the time or random bytes takes one of the
callables below, and ``gateway/runtime.py`` holds the real ones. Tests pass fixed ones (``counter_ids``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

__all__ = ["Clock", "IdFactory", "RandomBytes", "counter_ids", "custom_call_item_id"]

IdFactory = Callable[[str], str]
"""A prefix (``"msg"``, ``"fc"``, …) → a fresh id ``"<prefix>_…"``, unique for the life of the data."""
Clock = Callable[[], float]
"""Seconds since the epoch, as ``time.time``."""
RandomBytes = Callable[[int], bytes]
"""n → n unpredictable bytes, as ``os.urandom`` (nonces, keys)."""


def counter_ids(start: int = 0) -> IdFactory:
    """A deterministic id factory: ``<prefix>_`` + a counter in the width of the real ids (24 hex digits)."""
    counter = itertools.count(start)
    return lambda prefix: f"{prefix}_{next(counter):024x}"


def custom_call_item_id(upstream_item_id: str | None, call_id: str | None) -> str:
    """``ctc_`` + the upstream item id's suffix, or a hash of the call id when there is no item id.

    The same upstream item always maps to the same public id, so a retried or replayed stream and
    the non-streaming body agree.
    """
    if upstream_item_id:
        _, sep, suffix = upstream_item_id.partition("_")
        return "ctc_" + (suffix if sep and suffix else upstream_item_id)
    digest = hashlib.blake2b((call_id or "").encode(), digest_size=8).hexdigest()
    return "ctc_" + digest
