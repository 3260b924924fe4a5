"""The real clock, ids and randomness: the impure edge the pure core (``protocol/``, ``translate/``) is handed.

Everything in ``protocol/`` and ``translate/`` that needs the time, a fresh id or random bytes takes them as
arguments (``gateway.protocol.ids.Clock`` / ``IdFactory`` / ``RandomBytes``); the layers that do I/O pass these.
"""

from __future__ import annotations

import os
import secrets
import time

__all__ = ["clock", "new_id", "random_bytes"]

clock = time.time
random_bytes = os.urandom


def new_id(prefix: str) -> str:
    """``<prefix>_`` + 96 random bits in hex."""
    return f"{prefix}_{secrets.token_hex(12)}"
