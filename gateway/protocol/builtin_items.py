"""Stored (public) forms of the client-executed built-in tools' items, as the newest openai SDK models them.

Clients send these items in their input forms, where ``status`` is optional (``shell_call_output``,
``shell_call``, ``local_shell_call``); the output-item models that ``input_items`` and conversation listings are
read with require it. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["public_builtin_item"]

_STATUS_DEFAULTS = {
    "shell_call_output": "completed", "shell_call": "completed", "local_shell_call": "completed",
    "apply_patch_call": "completed", "apply_patch_call_output": "completed",
}


def public_builtin_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """``item`` with the fields its stored form requires (a missing ``status``); other items unchanged."""
    out = dict(item)
    default = _STATUS_DEFAULTS.get(str(out.get("type")))
    if default is not None and out.get("status") is None:
        out["status"] = default
    return out
