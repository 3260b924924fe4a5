"""Conversation wire shapes (OpenAI's ``types/conversations``): the ``conversation`` request field, item
normalization and metadata checks. Pure: no I/O, no store.

Items in a conversation are in public (output) form, each with an id: a message's string content becomes one
``input_text`` part (``output_text`` for the assistant) and it gets ``status: "completed"``; given ids are
kept (``ctc_`` custom calls included), missing ones are made with the caller's id factory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol.builtin_items import public_builtin_item
from gateway.protocol.ids import IdFactory

__all__ = ["MAX_ITEMS_PER_CALL", "check_metadata", "conversation_item", "conversation_ref", "request_items"]

# OpenAI: "You may add up to 20 items at a time" (conversations.create and conversations.items.create).
MAX_ITEMS_PER_CALL = 20

_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    # the client-executed built-in tools (gateway.translate.builtin_tools.ITEM_ID_PREFIX)
    "apply_patch_call": "apc",
    "apply_patch_call_output": "apco",
    "shell_call": "sh",
    "shell_call_output": "sho",
    "local_shell_call": "lsh",
    "local_shell_call_output": "lsho",
}


def conversation_ref(body: Mapping[str, Any]) -> str | None:
    """The conversation id a Responses request names (``"conv_…"`` or ``{"id": "conv_…"}``), or None."""
    conv = body.get("conversation")
    if conv is None:
        return None
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return conv
    raise InvalidRequest("'conversation' must be a conversation id or an object with an 'id'.",
                         param="conversation", code="invalid_type")


def conversation_item(item: Mapping[str, Any], ids: IdFactory) -> dict[str, Any]:
    """The public form of one item as a conversation holds it, with an id (a fresh one from ``ids`` if it has
    none)."""
    out = public_builtin_item(item)
    if "type" not in out and "role" in out:
        out["type"] = "message"
    if out.get("type") == "message":
        content = out.get("content")
        if isinstance(content, str):
            if out.get("role") == "assistant":
                out["content"] = [{"type": "output_text", "text": content, "annotations": []}]
            else:
                out["content"] = [{"type": "input_text", "text": content}]
        out.setdefault("status", "completed")
    if not isinstance(out.get("id"), str) or not out["id"]:
        out["id"] = ids(_ID_PREFIX.get(str(out.get("type")), "item"))
    return out


def request_items(raw: Any, param: str = "items") -> list[dict[str, Any]]:
    """The ``items`` of conversations.create / conversations.items.create, checked (at most 20 objects, each
    with a ``type`` or a ``role``); not yet normalized (``item_reference``s are the caller's to resolve)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest(f"'{param}' must be an array of items.", param=param, code="invalid_type")
    if len(raw) > MAX_ITEMS_PER_CALL:
        raise InvalidRequest(f"'{param}' holds {len(raw)} items; at most {MAX_ITEMS_PER_CALL} may be added at a "
                             "time.", param=param, code="array_above_max_length")
    for i, item in enumerate(raw):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("Each item must be an object.", param=p, code="invalid_type")
        if not isinstance(item.get("type"), str) and not isinstance(item.get("role"), str):
            raise InvalidRequest("Each item needs a 'type' (or a message 'role').", param=f"{p}.type",
                                 code="missing_required_parameter")
        if "id" in item and item["id"] is not None and not isinstance(item["id"], str):
            raise InvalidRequest("An item's 'id' must be a string.", param=f"{p}.id", code="invalid_type")
        if item.get("type") == "item_reference" and (not isinstance(item.get("id"), str) or not item["id"]):
            raise InvalidRequest("An item_reference needs the id of a stored item.", param=f"{p}.id",
                                 code="invalid_value")
    return raw


def check_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 pairs, string keys up to 64 characters, string values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must be an object of string values.", param=param, code="invalid_type")
    if len(value) > 16:
        raise InvalidRequest(f"'{param}' may hold at most 16 keys.", param=param, code="invalid_value")
    for key, val in value.items():
        if len(key) > 64:
            raise InvalidRequest(f"'{param}' keys are at most 64 characters.", param=f"{param}.{key[:64]}",
                                 code="invalid_value")
        if not isinstance(val, str):
            raise InvalidRequest(f"'{param}' values must be strings.", param=f"{param}.{key}", code="invalid_type")
        if len(val) > 512:
            raise InvalidRequest(f"'{param}' values are at most 512 characters.", param=f"{param}.{key}",
                                 code="invalid_value")
    return dict(value)
