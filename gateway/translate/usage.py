"""Usage in OpenAI's Responses shape, whatever the upstream sent. Pure.

vLLM's ``/v1/responses`` usage carries extra per-turn arrays in its details
(``input_tokens_details.input_tokens_per_turn: []``, ``output_tokens_details.tool_output_tokens`` …) that
strict client schemas reject (the OpenAI Agents SDK for JavaScript expects number-valued details). The
client gets exactly ``input_tokens``, ``input_tokens_details.cached_tokens`` and ``.cache_write_tokens``,
``output_tokens``, ``output_tokens_details.reasoning_tokens`` and ``total_tokens``: in streams, bodies and the store.
The newest openai SDK's ``ResponseUsage`` requires ``cache_write_tokens`` (0 when vLLM does not report it); responses
stored before it was sent get it when they are read back (``public_response``, ``public_event``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_usage", "normalize_usage", "public_event", "public_response"]


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
        "input_tokens_details": {"cached_tokens": _int(ind.get("cached_tokens")),
                                 "cache_write_tokens": _int(ind.get("cache_write_tokens"))},
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
        "input_tokens_details": {key: na["input_tokens_details"][key] + nb["input_tokens_details"][key]
                                 for key in ("cached_tokens", "cache_write_tokens")},
        "output_tokens": na["output_tokens"] + nb["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": na["output_tokens_details"]["reasoning_tokens"]
                                  + nb["output_tokens_details"]["reasoning_tokens"]},
        "total_tokens": na["total_tokens"] + nb["total_tokens"],
    }


def public_response(response: dict[str, Any]) -> dict[str, Any]:
    """A stored Response object as the client gets it now: its usage (when known) in today's shape. The same
    object when nothing changes (most reads), a shallow copy otherwise."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return response
    fixed = normalize_usage(usage)
    return response if fixed == usage else {**response, "usage": fixed}


def public_event(event: dict[str, Any]) -> dict[str, Any]:
    """A stored stream event (a background response's) as the client gets it now: the ``response`` it carries
    through ``public_response``."""
    response = event.get("response")
    if not isinstance(response, dict):
        return event
    fixed = public_response(response)
    return event if fixed is response else {**event, "response": fixed}
