"""Request rewriting: the client's Responses request -> the body vLLM's /v1/responses accepts.

A pure function of the request body, its ``ResolvedToolContext`` and the history loaded for
``previous_response_id``. Anything not named here passes through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.translate.builtin_tools import (
    BUILTIN_CALL_TYPES,
    BUILTIN_OUTPUT_TYPES,
    BUILTIN_TOOL_TYPES,
    builtin_history,
)
from gateway.translate.mcp_items import denied_history, mcp_call_history, mcp_name
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo
from gateway.translate.web_search import search_function_name, search_history

__all__ = ["INPUT_PARAM_SCHEMA", "build_upstream_request", "upstream_input_items", "upstream_tools"]

INPUT_PARAM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The raw free-form input for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}

# The only `include` values vLLM 0.32 accepts; any other is a 400 there (see vllm-upstream-behaviour §1).
VLLM_INCLUDES = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
})

# Fields the gateway owns: state lives here, not in vLLM.
_GATEWAY_FIELDS = ("previous_response_id", "store", "conversation", "background")


def custom_tool_description(tool: Mapping[str, Any]) -> str:
    """The original description plus the input format, so the model sees any grammar in full."""
    parts = [str(tool["description"])] if tool.get("description") else []
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax = fmt.get("syntax")
        kind = "Lark grammar" if syntax == "lark" else "regular expression" if syntax == "regex" else str(syntax)
        parts.append(
            f"This is a free-form tool: put the raw text in `input`, not JSON. The input must match this {kind} "
            f"({syntax}):\n{fmt.get('definition')}"
        )
    else:
        parts.append("This is a free-form tool: put the raw text in `input`, not JSON.")
    return "\n\n".join(parts)


def _upstream_tool(info: ToolInfo) -> dict[str, Any]:
    if info.kind == "custom":
        return {
            "type": "function",
            "name": info.upstream_name,
            "description": custom_tool_description(info.definition),
            "parameters": INPUT_PARAM_SCHEMA,
            # strict makes vLLM constrain the arguments to the schema; without it the tiny model answered
            # non-objects (null, Infinity) for a named call (docs/vllm-findings.md §f).
            "strict": True,
        }
    if info.kind in BUILTIN_TOOL_TYPES:  # apply_patch / shell / local_shell: strict by the custom tools' rule
        return {k: v for k, v in info.definition.items() if k != "type"} | {"type": "function", "strict": True}
    if info.kind in ("mcp", "web_search"):  # already in function form (mcp_items.tool_function, web_search)
        return {k: v for k, v in info.definition.items() if k not in ("server_label", "web_search_tool")}
    tool = dict(info.definition)
    tool["name"] = info.upstream_name
    tool.pop("defer_loading", None)
    return tool


def upstream_tools(ctx: ResolvedToolContext) -> list[dict[str, Any]]:
    allowed = ctx.allowed_upstream_names
    tools = [_upstream_tool(i) for i in ctx.callable_tools if allowed is None or i.upstream_name in allowed]
    if allowed is None:
        tools += [dict(t) for t in ctx.other_tools]
    return tools


def _check_output_parts(output: Any, param: str) -> Any:
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise InvalidRequest("A tool output must be a string or an array of content parts.", param=param,
                             code="invalid_type")
    for k, part in enumerate(output):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in ("input_text", "input_image", "input_file"):
            raise InvalidRequest(f"Unsupported tool output content part {ptype!r}: expected input_text, "
                                 "input_image or input_file.", param=f"{param}[{k}]", code="invalid_value")
    return upstream_tool_output(output, param)


def upstream_tool_output(parts: list[Any], param: str) -> Any:
    """Content-array tool outputs in the form vLLM 0.32 accepts (docs/vllm-findings.md §a).

    Text parts pass as they are (vLLM joins them, the same prompt as a string). Image parts pass with the
    ``detail`` vLLM requires; a text-only model then answers its own clear 400. File parts are refused by
    vLLM on every path, so the gateway names the part in a 400 instead of dropping it.
    """
    out: list[Any] = []
    for k, part in enumerate(parts):
        if part["type"] == "input_file":
            raise InvalidRequest(
                f"Tool output part {k} is an input_file: the upstream model server (vLLM) does not accept files "
                "in tool outputs. Send the file's text as an input_text part instead.",
                param=f"{param}[{k}]", code="unsupported_tool_output_part",
            )
        if part["type"] == "input_image" and not part.get("detail"):
            part = {**part, "detail": "auto"}
        out.append(part)
    return out


def _mcp_upstream_name(ctx: ResolvedToolContext, item: Mapping[str, Any]) -> str:
    label, name = str(item.get("server_label") or ""), str(item.get("name") or "")
    info = ctx.find_mcp(label, name)
    return info.upstream_name if info is not None else mcp_name(label, name)


def _namespace(item: Mapping[str, Any], param: str) -> str | None:
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise InvalidRequest("A call's 'namespace' must be a string.", param=f"{param}.namespace",
                             code="invalid_type")
    return namespace


def upstream_input_items(items: Sequence[Any], ctx: ResolvedToolContext, param: str = "input") -> list[Any]:
    out: list[Any] = []
    requests = {it["id"]: it for it in items if isinstance(it, dict) and it.get("type") == "mcp_approval_request"
                and isinstance(it.get("id"), str)}
    for i, item in enumerate(items):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("Each input item must be an object.", param=p, code="invalid_type")
        itype = item.get("type")
        if itype in ("mcp_list_tools", "mcp_approval_request"):
            continue  # the listing becomes the tools; a request is answered by an mcp_approval_response
        if itype == "mcp_call":
            out += mcp_call_history(item, _mcp_upstream_name(ctx, item))
            continue
        if itype == "web_search_call":  # the call and what it found (gateway.translate.web_search)
            search = ctx.web_search
            out += search_history(item, search.upstream_name if search is not None
                                  else search_function_name(ctx.by_upstream_name))
            continue
        if itype == "mcp_approval_response":
            # Approved: the call the gateway then runs follows in the history. Denied: the model is told.
            request_id = item.get("approval_request_id")
            if not isinstance(request_id, str):
                raise InvalidRequest("An mcp_approval_response needs a string 'approval_request_id'.",
                                     param=f"{p}.approval_request_id", code="invalid_type")
            request = requests.get(request_id)
            if request is not None and item.get("approve") is False:
                out += denied_history(request, _mcp_upstream_name(ctx, request),
                                      item.get("reason") if isinstance(item.get("reason"), str) else None)
            continue
        if itype in BUILTIN_OUTPUT_TYPES or (isinstance(itype, str) and itype in BUILTIN_CALL_TYPES.values()):
            out.append(builtin_history(item, p))  # the function call / output vLLM was offered
            continue
        if itype == "custom_tool_call":
            raw = item.get("input")
            if not isinstance(raw, str) or not isinstance(item.get("call_id"), str):
                raise InvalidRequest("A custom_tool_call item needs a string 'call_id' and 'input'.", param=p,
                                     code="invalid_value")
            out.append({
                "type": "function_call",
                "call_id": item["call_id"],
                "name": ctx.to_upstream_name(str(item.get("name", "")), _namespace(item, p)),
                "arguments": orjson.dumps({"input": raw}).decode(),
                "status": "completed",
            })
        elif itype == "custom_tool_call_output" or itype == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"A {itype} item needs a string 'call_id'.", param=p, code="invalid_value")
            out.append({"type": "function_call_output", "call_id": item["call_id"],
                        "output": _check_output_parts(item.get("output"), f"{p}.output")})
        elif itype == "function_call":
            call = {k: v for k, v in item.items() if k not in ("namespace", "caller", "async")}
            namespace = _namespace(item, p)
            if namespace:
                call["name"] = ctx.to_upstream_name(str(item.get("name", "")), namespace)
            if isinstance(call.get("id"), str) and not call["id"].startswith("fc_"):
                call.pop("id")
            out.append(call)
        elif itype == "reasoning" and "encrypted_content" in item:
            # vLLM answers 400 "Encrypted content is not supported" even for null.
            out.append({k: v for k, v in item.items() if k != "encrypted_content"})
        elif item.get("role") == "developer" and "tools" in item and itype in (None, "message"):
            msg = {k: v for k, v in item.items() if k != "tools"}
            msg.setdefault("content", "")
            out.append(msg)
        else:
            out.append(item)
    return out


def build_upstream_request(
    body: Mapping[str, Any], ctx: ResolvedToolContext, history: Sequence[Any] = ()
) -> dict[str, Any]:
    """The upstream body: tools normalized, history expanded, state kept out of vLLM."""
    up = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    up["store"] = False
    # The gateway fits the prompt itself, by whole items (gateway.engine.context): vLLM's own "auto" would cut the
    # rendered prompt's tokens from the left, through the system prompt or between a call and its output.
    up.pop("truncation", None)
    new_input = body.get("input")
    if isinstance(new_input, str):
        new_items: list[Any] = [{"type": "message", "role": "user", "content": new_input}] if history else []
        up["input"] = upstream_input_items([*history, *new_items], ctx) if history else new_input
    elif isinstance(new_input, list):
        up["input"] = upstream_input_items([*history, *new_input], ctx)
    elif new_input is None and history:
        up["input"] = upstream_input_items(list(history), ctx)

    up.pop("tools", None)
    up.pop("tool_choice", None)
    tools = upstream_tools(ctx)
    if ctx.upstream_tool_choice == "none":
        # vLLM renders tools into the prompt even with "none" (unless --exclude-tools-when-tool-choice-none):
        # leaving them out keeps the model answering in text.
        up["tool_choice"] = "none"
    elif tools:
        up["tools"] = tools
        up["tool_choice"] = ctx.upstream_tool_choice
    elif ctx.tool_choice_given:
        up["tool_choice"] = ctx.upstream_tool_choice
    include = body.get("include")
    if isinstance(include, list):
        kept = [v for v in include if v in VLLM_INCLUDES]
        if kept:
            up["include"] = kept
        else:
            up.pop("include", None)
    return up
