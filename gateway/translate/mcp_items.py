"""Gateway-owned MCP items: their upstream function names, client items and history form. Pure; no I/O.

A remote MCP tool (``{"type":"mcp","server_label":L,…}``) never reaches vLLM as such. The gateway lists the
server's tools (an ``mcp_list_tools`` item) and offers each one upstream as a function under a name it chooses
(``mcp_name``: unique, at most 64 characters, reversible through the request's tool context). A model call
of such a function is *gateway-owned*: the client never sees its ``function_call`` frames, it sees an
``mcp_call`` (or, when approval is required, an ``mcp_approval_request``) built here, and the gateway runs
the call. In later requests' history, ``mcp_call`` items go upstream as a function call plus its output, so
the model sees what it called and what came back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "CEILING_APPROVAL",
    "McpCallOutcome",
    "allowed_names",
    "approval_request_item",
    "approval_required",
    "call_failed_text",
    "denied_history",
    "list_tools_item",
    "mcp_call_history",
    "mcp_call_item",
    "mcp_name",
    "tool_allowed",
    "tool_function",
]

UPSTREAM_NAME_LIMIT = 64


@dataclass(frozen=True, slots=True)
class McpCallOutcome:
    """What a gateway-run call gave: ``output`` (the text the model sees) or ``error`` (an openai
    ``McpToolCallError``: ``mcp_tool_execution_error`` / ``http_error`` / ``mcp_protocol_error``)."""

    output: str | None = None
    error: dict[str, Any] | None = None
_ALLOWED_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _clean(text: str) -> str:
    return "".join(c if c in _ALLOWED_CHARS else "_" for c in text)


def mcp_name(server_label: str, tool: str) -> str:
    """The upstream function name of an MCP server's tool: ``mcp__<label>__<tool>``, shortened with a hash
    past 64 characters or when cleaning changed it (so two tools never share a name)."""
    name = f"mcp__{_clean(server_label)}__{_clean(tool)}"
    if len(name) <= UPSTREAM_NAME_LIMIT and _clean(server_label) == server_label and _clean(tool) == tool:
        return name
    digest = hashlib.blake2b(f"{server_label}\x00{tool}".encode(), digest_size=4).hexdigest()
    room = UPSTREAM_NAME_LIMIT - len("mcp____") - len(digest) - 1
    label_part = _clean(server_label)[: max(8, room // 3)]
    tool_part = _clean(tool)[: room - len(label_part)]
    return f"mcp__{label_part}__{tool_part}_{digest}"


def allowed_names(tool: Mapping[str, Any]) -> frozenset[str] | None:
    """``allowed_tools`` as a set of names (a list, or ``{"tool_names": [...]}``); None: every tool."""
    allowed = tool.get("allowed_tools")
    if isinstance(allowed, dict):
        allowed = allowed.get("tool_names")
    if allowed is None:
        return None
    return frozenset(str(n) for n in allowed if isinstance(n, str))


# An mcp tool bound to a servers-file entry carries the file's require_approval under this key (gateway.mcp.hub):
# the request may only add approvals to it. Internal: the bound tools are never echoed or stored.
CEILING_APPROVAL = "_configured_require_approval"


def tool_allowed(server: Mapping[str, Any], tool: Mapping[str, Any]) -> bool:
    """Whether a listed tool passes the server's ``allowed_tools`` (names, and ``read_only``: the tool's
    ``readOnlyHint`` annotation must be true)."""
    names = allowed_names(server)
    if names is not None and tool.get("name") not in names:
        return False
    allowed = server.get("allowed_tools")
    if isinstance(allowed, dict) and allowed.get("read_only") is True:
        annotations = tool.get("annotations")
        return isinstance(annotations, dict) and annotations.get("readOnlyHint") is True
    return True


def approval_required(tool: Mapping[str, Any], name: str) -> bool:
    """OpenAI's rule (``always`` by default; see ``_approval_required``), and the servers file's ceiling."""
    if CEILING_APPROVAL in tool and _approval_required(tool[CEILING_APPROVAL], name):
        return True
    return _approval_required(tool.get("require_approval", "always"), name)


def _approval_required(policy: Any, name: str) -> bool:
    """The object form names tools either way (``never`` wins for a tool listed in both, as the narrower intent;
    unlisted tools need approval)."""
    if policy is None:
        policy = "always"
    if policy == "never":
        return False
    if isinstance(policy, dict):
        never = raw if isinstance(raw := policy.get("never"), dict) else {}
        always = raw if isinstance(raw := policy.get("always"), dict) else {}
        if name in (never.get("tool_names") or ()):
            return False
        if name in (always.get("tool_names") or ()):
            return True
        # Only a "never" list given: the rest need approval; only an "always" list: the rest do not.
        return not (always and not never)
    return True


def list_tools_item(server_label: str, tools: Iterable[Mapping[str, Any]], error: str | None = None, *,
                    item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "mcp_list_tools", "server_label": server_label,
            "tools": [{"name": t.get("name"), "description": t.get("description"),
                       "input_schema": t.get("input_schema") or {"type": "object"},
                       "annotations": t.get("annotations")} for t in tools],
            "error": error}


def tool_function(upstream_name: str, tool: Mapping[str, Any], server: Mapping[str, Any]) -> dict[str, Any]:
    """A listed MCP tool as the function vLLM is offered."""
    desc = str(tool.get("description") or "").strip()
    server_desc = str(server.get("server_description") or "").strip()
    label = server.get("server_label")
    full = f"{desc}\n\n(Tool '{tool.get('name')}' of the MCP server '{label}'" + (
        f": {server_desc})" if server_desc else ")")
    schema = tool.get("input_schema")
    return {"type": "function", "name": upstream_name, "description": full.strip(),
            "parameters": schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}}


def mcp_call_item(server_label: str, name: str, arguments: str = "", *, item_id: str,
                  approval_request_id: str | None = None, status: str = "in_progress") -> dict[str, Any]:
    return {"id": item_id, "type": "mcp_call", "server_label": server_label, "name": name,
            "arguments": arguments, "output": None, "error": None, "approval_request_id": approval_request_id,
            "status": status}


def approval_request_item(server_label: str, name: str, arguments: str = "", *,
                          item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "mcp_approval_request", "server_label": server_label,
            "name": name, "arguments": arguments}


def call_failed_text(error: Mapping[str, Any]) -> str:
    """What the model is told when a call failed (it continues the loop with this as the output)."""
    etype = error.get("type")
    if etype == "mcp_tool_execution_error":
        content = error.get("content")
        texts = [str(c.get("text")) for c in content or () if isinstance(c, dict) and c.get("text")] \
            if isinstance(content, list) else []
        detail = "\n".join(texts) or orjson.dumps(content).decode()
        return f"The tool reported an error: {detail}"
    return f"The tool call failed ({etype}): {error.get('message')}"


def _content_id(prefix: str, item: Mapping[str, Any]) -> str:
    """An id for a history item that came without one: a hash of the item, so the same history reaches the
    model with the same ids on every turn (and stays a cacheable prefix)."""
    digest = hashlib.blake2b(orjson.dumps(item, option=orjson.OPT_SORT_KEYS), digest_size=12).hexdigest()
    return f"{prefix}_{digest}"


def mcp_call_history(item: Mapping[str, Any], upstream_name: str) -> list[dict[str, Any]]:
    """An ``mcp_call`` as what the model sees on the next turn: its function call and the call's output."""
    call_id = str(item.get("id") or _content_id("mcp", item))
    error = item.get("error")
    if isinstance(error, dict):
        output = call_failed_text(error)
    elif isinstance(error, str) and error:
        output = f"The tool call failed: {error}"
    else:
        output = str(item.get("output") or "")
    return [{"type": "function_call", "call_id": call_id, "name": upstream_name,
             "arguments": str(item.get("arguments") or "{}"), "status": "completed"},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


def denied_history(request: Mapping[str, Any], upstream_name: str, reason: str | None) -> list[dict[str, Any]]:
    """A denied approval request as what the model sees: the call, and that the user refused it."""
    call_id = str(request.get("id") or _content_id("mcpr", request))
    why = f" Reason: {reason}" if reason else ""
    return [{"type": "function_call", "call_id": call_id, "name": upstream_name,
             "arguments": str(request.get("arguments") or "{}"), "status": "completed"},
            {"type": "function_call_output", "call_id": call_id,
             "output": f"The user denied this tool call; it was not run.{why}"}]
