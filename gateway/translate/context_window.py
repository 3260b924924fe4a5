"""The prompt as vLLM renders it, for counting (issue 20): an upstream body (either API) as the request vLLM's
``POST /tokenize`` takes (chat messages, tools, chat-template kwargs), a cheap byte bound on its token count, and
the whole-item groups ``truncation: "auto"`` may drop.

Pure: no I/O. ``tokenize_request`` mirrors vLLM 0.32's rendering of a ``/v1/responses`` request
(``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages``, ``construct_tool_dicts``;
``ResponsesRequest.build_chat_params``) and of a ``/v1/chat/completions`` request (``ChatCompletionRequest
.build_chat_params``), so that ``/tokenize`` counts what generation will count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "PER_MESSAGE_TOKENS",
    "REWRITE_SLACK_PER_ITEM",
    "REWRITE_SLACK_PER_TOOL",
    "TEMPLATE_OVERHEAD_TOKENS",
    "droppable_groups",
    "input_token_bound",
    "request_token_bound",
    "tokenize_request",
]

# The bound of ``input_token_bound`` (see there): what a chat template adds around the rendered text. Role markers
# and special tokens per message (``<|im_start|>user\n … <|im_end|>\n`` is 5 tokens; Llama 3's header 4–5) and a
# fixed preamble (the tool instructions of hermes/Qwen templates, about 60–150 tokens; Llama 3.1's date header
# about 30), each with margin.
PER_MESSAGE_TOKENS = 16
TEMPLATE_OVERHEAD_TOKENS = 512
# ``request_token_bound``: what the rewrite to the upstream form adds, in bound tokens (twice its bytes): a custom
# tool's description suffix and ``input`` schema (about 350 bytes), an ``mcp_call``'s expansion into a call and
# its output, ids and keys of the upstream item form (under 120 bytes).
REWRITE_SLACK_PER_TOOL = 768
REWRITE_SLACK_PER_ITEM = 256

# Items a chat template renders as part of the conversation's frame, never dropped by truncation.
_PINNED_ROLES = frozenset({"system", "developer"})
# Call items paired with their output by ``call_id``.
_CALL_TYPES = frozenset({
    "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "local_shell_call",
    "local_shell_call_output", "computer_call", "computer_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output",
})


# ---------------------------------------------------------------------------------------------- /tokenize body


def _text_parts(content: Any) -> Any:
    """Responses content parts in the chat form ``/tokenize`` validates: ``input_text``/``output_text`` become
    ``text`` (vLLM's renderer reads both the same way); other parts pass as they are."""
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text") and "text" in part:
            out.append({"type": "text", "text": part["text"]})
        else:
            out.append(part)
    return out


def _chat_message(item: Mapping[str, Any]) -> dict[str, Any]:
    """A message item as a chat message: the fields a template reads (``type``/``id``/``status`` are dropped
    by ``/tokenize``'s validation anyway)."""
    msg = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
    if "content" in msg:
        msg["content"] = _text_parts(msg["content"])
    return msg


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        return str(parts[0]["text"])
    return None


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages`` for a (non-Harmony) ``/v1/responses`` body: the instructions as a
    system message, then the items, where a call, reasoning or assistant text joins the assistant message before
    it when that message lacks the part (so a reasoning item and the call after it are one assistant turn)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        return messages
    for item in raw if isinstance(raw, list) else ():
        if not isinstance(item, dict):
            continue
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        itype = item.get("type")
        if itype in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") if itype == "function_call" else \
                orjson.dumps({"input": item.get("input") or ""}).decode()
            name = str(item.get("name", ""))
            if item.get("namespace"):
                name = f"{item['namespace']}__{name}"
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": arguments}}
            if prev is not None and isinstance(prev.get("tool_calls"), list):
                prev["tool_calls"].append(call)
            elif prev is not None and prev.get("tool_calls") is None:
                prev["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif itype == "reasoning":
            thought = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = thought
            else:
                messages.append({"role": "assistant", "reasoning": thought})
        elif itype in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": _text_parts(item.get("output")),
                             "tool_call_id": item.get("call_id")})
        elif item.get("role") == "assistant" and itype in (None, "message"):
            content = item.get("content")
            text = content if isinstance(content, str) else _first_text(content)
            if text is None:
                continue
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif "role" in item:
            messages.append(_chat_message(item))
        # Any other item is a 400 at vLLM ("Unsupported input item type"); the generation request says so.
    return messages


def _responses_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """vLLM's ``construct_tool_dicts``: the function tools in the chat form its template renders."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                if k in t}}
             for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    return tools or None


def _continues_final(raw: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the last input item is an unfinished message or reasoning."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[-1], dict):
        return False
    last = raw[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress",
                                                                                               "incomplete")


def tokenize_request(upstream_body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``POST /tokenize`` body that renders ``upstream_body`` (a ``/v1/chat/completions`` body when it has
    ``messages``, else a ``/v1/responses`` one) exactly as generation will: same messages, tools and
    chat-template kwargs."""
    kwargs: dict[str, Any] = {}
    user_kwargs = upstream_body.get("chat_template_kwargs")
    if isinstance(user_kwargs, dict):
        kwargs.update(user_kwargs)
    req: dict[str, Any] = {}
    if isinstance(upstream_body.get("model"), str):
        req["model"] = upstream_body["model"]
    if "messages" in upstream_body:
        req["messages"] = upstream_body.get("messages") or []
        tools = upstream_body.get("tools")
        effort = upstream_body.get("reasoning_effort")
        req["add_generation_prompt"] = upstream_body.get("add_generation_prompt", True)
        req["continue_final_message"] = bool(upstream_body.get("continue_final_message", False))
    else:
        req["messages"] = responses_messages(upstream_body)
        tools = _responses_tools(upstream_body)
        reasoning = upstream_body.get("reasoning")
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        continues = _continues_final(upstream_body.get("input"))
        req["add_generation_prompt"] = not continues
        req["continue_final_message"] = continues
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if not (isinstance(user_kwargs, dict) and "enable_thinking" in user_kwargs):
            kwargs["enable_thinking"] = effort != "none"
    if tools:
        req["tools"] = tools
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    return req


# ---------------------------------------------------------------------------------------------- the cheap bound


def input_token_bound(upstream_body: Mapping[str, Any]) -> int:
    """An upper bound on the input tokens of ``upstream_body``, from bytes alone.

    Why it holds: with a byte-level BPE tokenizer (GPT-2/Llama 3/Qwen/Mistral Tekken) every token stands for at
    least one byte of the rendered text, and SentencePiece with byte fallback adds at most its one dummy-prefix
    piece per segment, so a text has at most as many tokens as UTF-8 bytes. The rendered text is the messages'
    text (fewer bytes than their JSON here, which adds quotes, keys and escapes) plus what the template re-serializes
    as JSON — tools and call arguments — which ``tojson``'s ``", "``/``": "`` separators make at most twice as
    long as the compact JSON measured here: the bound takes twice the JSON bytes of the whole input. On top come
    the template's own tokens (``PER_MESSAGE_TOKENS`` per item, ``TEMPLATE_OVERHEAD_TOKENS`` once). A template
    that indents its JSON (``tojson(indent=4)``) can exceed it for deeply nested tool schemas."""
    size = 0
    items = 1
    for key in ("instructions", "input", "messages", "tools"):
        value = upstream_body.get(key)
        if value is None:
            continue
        size += len(orjson.dumps(value))
        if isinstance(value, list):
            items += len(value)
    return 2 * size + PER_MESSAGE_TOKENS * items + TEMPLATE_OVERHEAD_TOKENS


def request_token_bound(body: Mapping[str, Any], history: Sequence[Any]) -> int:
    """``input_token_bound`` of the upstream body the request (the client's body over its loaded history) will
    become, without building it: the client's form plus the rewrite's additions. Lets a small request skip the
    build altogether."""
    raw = body.get("input")
    tools = body.get("tools")
    items = [*history, *(raw if isinstance(raw, list) else () if raw is None else (raw,))]
    n_tools = len(tools) if isinstance(tools, list) else 0
    client_form = {"instructions": body.get("instructions"), "input": items, "tools": tools}
    # + 1: the instructions become a message of their own on the chat API.
    return input_token_bound(client_form) + REWRITE_SLACK_PER_TOOL * n_tools + REWRITE_SLACK_PER_ITEM * (
        len(items) + 1)


# ---------------------------------------------------------------------------------------------- truncation


def droppable_groups(items: Sequence[Any]) -> list[list[int]]:
    """The indexes of ``items`` (Responses items, oldest first) that ``truncation: "auto"`` may drop, as whole
    groups in the order they are dropped (oldest first). Never in a group: system and developer messages (the
    conversation's frame) and ``mcp_list_tools`` (it is the MCP tools' definition). A group holds a call with its
    output (same ``call_id``), an MCP approval request with its response, and reasoning with the item it precedes
    (the call or message it led to); the group holding the newest item is never dropped."""
    n = len(items)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    pinned: set[int] = set()
    by_key: dict[tuple[str, str], int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        itype = item.get("type")
        if (item.get("role") in _PINNED_ROLES and itype in (None, "message")) or itype == "mcp_list_tools":
            pinned.add(i)
            continue
        key: tuple[str, str] | None = None
        if itype in _CALL_TYPES and isinstance(item.get("call_id"), str):
            key = ("call", item["call_id"])
        elif itype == "mcp_approval_request" and isinstance(item.get("id"), str):
            key = ("approval", item["id"])
        elif itype == "mcp_approval_response" and isinstance(item.get("approval_request_id"), str):
            key = ("approval", item["approval_request_id"])
        if key is not None:
            if key in by_key:
                union(by_key[key], i)
            else:
                by_key[key] = i
    # Reasoning joins the next item that is not pinned (a run of reasoning items joins the same one).
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "reasoning" and i not in pinned:
            nxt = next((j for j in range(i + 1, n) if j not in pinned), None)
            if nxt is not None:
                union(i, nxt)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        if i not in pinned:
            groups.setdefault(find(i), []).append(i)
    ordered = sorted(groups.values(), key=lambda g: g[0])
    last = n - 1
    while last >= 0 and last in pinned:
        last -= 1
    return [g for g in ordered if last not in g]
