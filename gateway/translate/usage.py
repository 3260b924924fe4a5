"""Usage in OpenAI's Responses shape, whatever the upstream sent. Pure.

vLLM's ``/v1/responses`` usage carries extra per-turn arrays in its details
(``input_tokens_details.input_tokens_per_turn: []``, ``output_tokens_details.tool_output_tokens`` …) that
strict client schemas reject (the OpenAI Agents SDK for JavaScript expects number-valued details). The
client gets exactly ``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``,
``output_tokens_details.reasoning_tokens`` and ``total_tokens``: in streams, bodies and the store.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_usage", "normalize_usage"]


def _int(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float) and value == value and value not in (float("inf"), float("-inf")):
        return max(int(value), 0)
    return 0


def normalize_usage(u: Any) -> dict[str, Any] | None:
    """OpenAI's usage object from an upstream one (None stays None: usage not known yet)."""
    if not isinstance(u, dict):
        return None
    ind = raw if isinstance(raw := u.get("input_tokens_details"), dict) else {}
    outd = raw if isinstance(raw := u.get("output_tokens_details"), dict) else {}
    inp, out = _int(u.get("input_tokens")), _int(u.get("output_tokens"))
    total = _int(u.get("total_tokens")) if "total_tokens" in u else inp + out
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": _int(ind.get("cached_tokens"))},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": _int(outd.get("reasoning_tokens"))},
        "total_tokens": total or inp + out,
    }


def add_usage(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The sum of two usage objects (a constrained answer is several upstream requests)."""
    na, nb = normalize_usage(a), normalize_usage(b)
    if na is None or nb is None:
        return na or nb
    return {
        "input_tokens": na["input_tokens"] + nb["input_tokens"],
        "input_tokens_details": {"cached_tokens": na["input_tokens_details"]["cached_tokens"]
                                 + nb["input_tokens_details"]["cached_tokens"]},
        "output_tokens": na["output_tokens"] + nb["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": na["output_tokens_details"]["reasoning_tokens"]
                                  + nb["output_tokens_details"]["reasoning_tokens"]},
        "total_tokens": na["total_tokens"] + nb["total_tokens"],
    }
