"""Response restoration: what the client sees is its own request echoed, not the normalized one.

vLLM echoes the function tools it was sent, its effective ``tool_choice``, ``metadata: null`` and
rewritten ``text``; these functions put back what the client sent and turn upstream calls of custom
and namespace tools into the items the client declared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.ids import custom_call_item_id
from gateway.translate.builtin_tools import BUILTIN_TOOL_TYPES, builtin_call_item
from gateway.translate.custom_input import InputDecoder, final_input
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo, public_tool
from gateway.translate.usage import normalize_usage

__all__ = ["RequestState", "build_request_state", "client_call_item", "restore_output", "restore_response"]

# Upstream-only keys that must not reach the client (input_messages would echo the normalized prompt).
_ITEM_STATUSES = ("in_progress", "completed", "incomplete")
_UPSTREAM_ONLY = ("input_messages", "output_messages", "kv_transfer_params", "ec_transfer_params")


@dataclass(frozen=True, slots=True)
class RequestState:
    """Everything the response path needs about one request, resolved at the entry."""

    ctx: ResolvedToolContext
    echo: Mapping[str, Any]
    response_id: str
    created_at: int
    max_unnamed_call_bytes: int = 256 * 1024
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Set when the request's include asks for reasoning.encrypted_content: the item -> its sealed blob.
    seal: Callable[[Mapping[str, Any]], str] | None = None
    # Items the gateway made before the model answered (a compaction item, gateway.engine.compaction): first in
    # the output, streamed before the upstream's items; ``lead_usage``: what making them cost, added to the usage.
    lead: tuple[dict[str, Any], ...] = ()
    lead_usage: Mapping[str, Any] | None = None
    # Events already sent for this response before its translator began (``FunctionSseTranslator.announce``:
    # created, in_progress, each lead item's added and progress events): numbering continues after them, and only
    # the lead items' done events remain.
    lead_announced: int = 0

    def with_sealed(self, item: dict[str, Any]) -> dict[str, Any]:
        """A reasoning item as the client gets it: with ``encrypted_content`` when it asked for it."""
        if self.seal is not None and item.get("type") == "reasoning":
            return {**item, "encrypted_content": self.seal(item)}
        return item


def build_request_state(body: Mapping[str, Any], ctx: ResolvedToolContext, *, response_id: str,
                        created_at: int, max_unnamed_call_bytes: int = 256 * 1024) -> RequestState:
    echo: dict[str, Any] = {
        "tools": [public_tool(t) for t in ctx.initial_tools],
        "tool_choice": ctx.tool_choice,
        "parallel_tool_calls": ctx.parallel_tool_calls,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store") if isinstance(body.get("store"), bool) else True,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
        "truncation": body.get("truncation") or "disabled",
    }
    if isinstance(body.get("model"), str):
        echo["model"] = body["model"]
    conversation = body.get("conversation")  # "conv_…" or {"id": "conv_…"}: echoed as OpenAI does, {"id"}
    conversation = conversation.get("id") if isinstance(conversation, dict) else conversation
    if isinstance(conversation, str) and conversation:
        echo["conversation"] = {"id": conversation}
    for key in ("user", "safety_identifier", "prompt_cache_key", "service_tier", "max_tool_calls", "reasoning",
                "background"):
        if key in body:
            echo[key] = body[key]
    return RequestState(ctx=ctx, echo=echo, response_id=response_id, created_at=created_at,
                        max_unnamed_call_bytes=max_unnamed_call_bytes)


def client_call_item(item: Mapping[str, Any], info: ToolInfo | None, input_value: str | None = None
                     ) -> dict[str, Any]:
    """The client's form of an upstream function_call item."""
    if info is not None and info.kind in BUILTIN_TOOL_TYPES:
        return builtin_call_item(info.kind, item)
    if info is not None and info.kind == "custom":
        out: dict[str, Any] = {
            "id": custom_call_item_id(item.get("id"), item.get("call_id")),
            "type": "custom_tool_call",
            "call_id": item.get("call_id"),
            "name": info.name,
            "input": input_value if input_value is not None else final_input(str(item.get("arguments") or "")),
            # Not in the output-item schema, but the stored item form requires it and the AI SDK drops a
            # custom call without "status": "completed" on output_item.done.
            "status": item.get("status") if item.get("status") in _ITEM_STATUSES else "completed",
        }
        if info.namespace:
            out["namespace"] = info.namespace
        return out
    out = dict(item)
    if info is not None:
        out["name"] = info.name
        out["namespace"] = info.namespace
    return out


def restore_response(upstream: Mapping[str, Any] | None, state: RequestState, *,
                     output: list[Any] | None = None, status: str | None = None,
                     error: Mapping[str, Any] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = dict(upstream) if upstream else {}
    for key in _UPSTREAM_ONLY:
        r.pop(key, None)
    r["id"] = state.response_id  # the gateway owns the id: one identity across the lifecycle and the store
    r["object"] = "response"
    r.setdefault("created_at", state.created_at)
    r.update(state.echo)
    r.setdefault("model", None)
    r.setdefault("incomplete_details", None)
    r.setdefault("temperature", None)
    r.setdefault("top_p", None)
    r["usage"] = normalize_usage(r.get("usage"))
    if status is not None:
        r["status"] = status
    r.setdefault("status", "in_progress")
    if output is not None:
        r["output"] = output
    r.setdefault("output", [])
    if error is not None:
        r["error"] = dict(error)
    else:
        r.setdefault("error", None)
    return r


def restore_output(items: list[Any], state: RequestState) -> list[Any]:
    """Non-streamed output: the same item conversion and parallel_tool_calls rule as the stream."""
    ctx = state.ctx
    out: list[Any] = []
    seen_call = False
    for item in items:
        if not isinstance(item, dict):
            continue
        if item.get("type") in ("function_call", "custom_tool_call"):
            if seen_call and not ctx.parallel_tool_calls:
                continue
            seen_call = True
        if item.get("type") == "function_call":
            info = ctx.lookup(item.get("name"))
            value = None
            if info is not None and info.kind == "custom":
                value = final_input(str(item.get("arguments") or ""), InputDecoder())
            out.append(client_call_item(item, info, value))
        else:
            out.append(state.with_sealed(item))
    return out
