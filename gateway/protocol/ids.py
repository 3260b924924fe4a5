"""Public item ids. Deterministic where the issue asks for stability, random only at the edge."""

from __future__ import annotations

import hashlib
import secrets

__all__ = ["custom_call_item_id", "new_id"]


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


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
