"""Stored items in the shape the newest openai SDK's item models require when they are listed (``input_items``,
conversation items): the store keeps what the client sent (a string ``content``, a ``function_call_output`` with
no ``status``…), which its ``ResponseItem`` / ``ConversationItem`` models reject. Applied when an item is read
back for a listing, so items stored before this shape was needed are listed in it too. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["listed_item"]

# Item types whose SDK model requires a status (``completed`` unless the item says otherwise).
_WITH_STATUS = frozenset({
    "message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
    "computer_call", "computer_call_output", "file_search_call", "web_search_call", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "tool_search_call", "tool_search_output", "program_output",
})
_STATUSES = frozenset({"in_progress", "completed", "incomplete", "failed", "searching", "generating",
                       "interpreting", "calling"})


def _part(part: Any, assistant: bool) -> Any:
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if assistant and kind in ("input_text", "text"):  # an assistant turn sent back as input_text: output_text
        part = {**part, "type": "output_text"}
        kind = "output_text"
    if kind == "output_text" and not isinstance(part.get("annotations"), list):
        return {**part, "annotations": []}
    if kind == "input_image" and part.get("detail") is None:
        return {**part, "detail": "auto"}
    return part


def listed_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """One stored item as a listing returns it (a copy; the stored item is not changed)."""
    out = dict(item)
    if "type" not in out and "role" in out:
        out["type"] = "message"
    kind = out.get("type")
    if kind == "message":
        assistant = out.get("role") == "assistant"
        content = out.get("content")
        if isinstance(content, str):
            content = [{"type": "output_text" if assistant else "input_text", "text": content}]
        if isinstance(content, list):
            out["content"] = [_part(p, assistant) for p in content]
    elif kind == "reasoning" and not isinstance(out.get("summary"), list):
        out["summary"] = []
    if kind in _WITH_STATUS and out.get("status") not in _STATUSES:
        out["status"] = "completed"
    return out
