"""Compaction's words and shapes (issue 20), pure: the summarization turn the upstream model answers, the message a
summary becomes when a ``compaction`` item comes back in an input, and the items of a compaction.

The prompt is written for coding agents and tool use. It was modelled on Codex's compact prompt
(codex-rs/core/templates/compact/prompt.md: a "context checkpoint" handoff summary for another model — progress
and decisions, constraints, next steps, critical data) and its summary prefix; the wording here is our own, and
adds what a tool-using agent loses first: the files, commands and calls already made and their results, so the
next turn does not repeat them. The history is rendered as a plain transcript inside one user message, so the same
turn works on both upstream APIs and needs no tool definitions (a custom or namespaced call in the history is
text here, not a call the model could be asked to repeat).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

__all__ = ["COMPACTION_INSTRUCTIONS", "SUMMARY_PREFIX", "compaction_input", "is_compaction", "item_text",
           "render_transcript", "summary_message", "user_messages"]

COMPACTION_INSTRUCTIONS = """\
You are compacting the context of a long agent session so that it can continue in a fresh context window. \
Another model will resume the work with only your summary and the user's messages. Write the summary it needs \
to carry on without asking again or repeating work.

Cover, in this order, with short headed sections and bullet points:
1. Task: what the user asked for, in their terms, and any constraints, preferences or acceptance criteria they gave.
2. Decisions: what was decided and why, including approaches tried and rejected.
3. Done so far: files read, created or changed (with paths), commands and tool calls run and what they showed, \
tests and their results. Quote exact identifiers, paths, error messages and values that later steps depend on.
4. Current state: what is in progress right now, and anything left half-done.
5. Remaining: the next concrete steps, in order, and open questions for the user.

Be factual and concise; do not invent progress that the transcript does not show; do not address the user. \
Write only the summary."""

# What the model sees in place of a compaction item: the summary, framed as earlier context it can build on.
SUMMARY_PREFIX = ("Earlier parts of this conversation were compacted to fit the context window. This is the "
                  "summary of that work, written for you to continue it; build on it and do not repeat what it "
                  "says is done:\n\n")

_ITEM_TEXT_LIMIT = 16_000  # characters of one item kept in the transcript (head and tail)


def is_compaction(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "compaction"


def summary_message(summary: str) -> dict[str, Any]:
    """The message the upstream gets where a compaction item was: earlier context, from the user's side (the
    only role every chat template accepts anywhere in a conversation)."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SUMMARY_PREFIX + summary}]}


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif part.get("type") in ("input_image", "input_file"):
            parts.append(f"[{part['type'][6:]}]")
    return "\n".join(parts)


def item_text(item: Mapping[str, Any]) -> tuple[str, str] | None:
    """A history item as (label, text) for the transcript; None for items that carry nothing to summarize."""
    itype = item.get("type") or ("message" if "role" in item else None)
    if itype == "message":
        return str(item.get("role") or "user"), _content_text(item.get("content"))
    if itype in ("function_call", "custom_tool_call"):
        args = item.get("arguments") if itype == "function_call" else item.get("input")
        ns = f"{item['namespace']}." if isinstance(item.get("namespace"), str) else ""
        return f"tool call {ns}{item.get('name', '')} ({item.get('call_id', '')})", str(args or "")
    if itype in ("function_call_output", "custom_tool_call_output"):
        out = item.get("output")
        return f"tool output ({item.get('call_id', '')})", out if isinstance(out, str) else _content_text(out)
    if itype == "mcp_call":
        text = f"arguments: {item.get('arguments', '')}\noutput: {item.get('output') or item.get('error') or ''}"
        return f"tool call {item.get('server_label', '')}.{item.get('name', '')}", text
    if itype == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        text = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict)) if isinstance(parts, list) else ""
        return ("assistant reasoning", text) if text else None
    if itype in ("compaction_trigger", "item_reference", "mcp_list_tools", "mcp_approval_request",
                 "mcp_approval_response"):
        return None
    if isinstance(itype, str):  # anything else the gateway passes on: its JSON, without ids
        return itype, _json({k: v for k, v in item.items() if k not in ("id", "type")})
    return None


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # what orjson cannot write (an integer past 64 bits, from a store's rows): the stdlib's JSON
        return json.dumps(value, default=str, ensure_ascii=False)


def _clip(text: str) -> str:
    if len(text) <= _ITEM_TEXT_LIMIT:
        return text
    half = _ITEM_TEXT_LIMIT // 2
    return f"{text[:half]}\n[… {len(text) - 2 * half} characters left out …]\n{text[-half:]}"


def render_transcript(items: Iterable[Any]) -> str:
    """The history as a plain transcript (compaction items already opened into summary messages)."""
    blocks = []
    for item in items:
        if isinstance(item, str):
            item = {"type": "message", "role": "user", "content": item}
        if not isinstance(item, dict):
            continue
        got = item_text(item)
        if got is None:
            continue
        label, text = got
        blocks.append(f"[{label}]\n{_clip(text)}")
    return "\n\n".join(blocks)


def compaction_input(items: Sequence[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The summarization turn's input: the transcript (and the session's own instructions) in one user message."""
    head = f"The session's instructions were:\n{instructions}\n\n" if instructions else ""
    text = (f"{head}<transcript>\n{render_transcript(items)}\n</transcript>\n\n"
            "Write the summary of this transcript now, as instructed.")
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def user_messages(items: Iterable[Any]) -> list[dict[str, Any]]:
    """The user's own messages of a history (what ``/v1/responses/compact`` returns before its compaction item);
    summaries of earlier compactions are not the user's and stay out."""
    out = []
    for item in items:
        if isinstance(item, dict) and (item.get("type") or "message") == "message" and item.get("role") == "user":
            if _content_text(item.get("content")).startswith(SUMMARY_PREFIX):
                continue
            out.append(item)
    return out
