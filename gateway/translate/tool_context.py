"""The resolved tool state of one request: built once at the entry, read by every later step.

Theory of operation: ``resolve_tool_context(body)`` reads the request's ``tools``, the ``tools`` that
``developer`` messages declare (dynamic tools), ``tool_choice`` and ``parallel_tool_calls``, validates
them, and returns an immutable ``ResolvedToolContext``. Request rewriting, stream translation, response
restoration and storage read that value; no other code looks at the raw tool fields.

Every tool has a *public* identity (``namespace``, ``name``) as the client declared it and an
*upstream* name, the function name vLLM sees: the same name for top-level tools, a flattened
``ns__member`` name (at most 64 characters, vLLM's limit) for namespace members.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from gateway.errors import InvalidRequest

ToolKind = Literal["function", "custom", "other"]

UPSTREAM_NAME_LIMIT = 64
_VALID_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
CALLABLE_TYPES = ("function", "custom")

__all__ = ["ResolvedToolContext", "ToolInfo", "flat_name", "resolve_tool_context"]


@dataclass(frozen=True, slots=True)
class ToolInfo:
    kind: ToolKind
    name: str
    upstream_name: str
    namespace: str | None
    definition: Mapping[str, Any]

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(syntax, definition)`` of a custom tool's grammar format, if it has one."""
        fmt = self.definition.get("format")
        if self.kind == "custom" and isinstance(fmt, dict) and fmt.get("type") == "grammar":
            return str(fmt.get("syntax")), str(fmt.get("definition"))
        return None


@dataclass(frozen=True, slots=True)
class ResolvedToolContext:
    initial_tools: tuple[Mapping[str, Any], ...]
    effective_tools: tuple[Mapping[str, Any], ...]
    tool_choice: Any
    tool_choice_given: bool
    parallel_tool_calls: bool
    parallel_tool_calls_given: bool
    by_upstream_name: Mapping[str, ToolInfo]
    other_tools: tuple[Mapping[str, Any], ...]
    allowed_upstream_names: frozenset[str] | None
    upstream_tool_choice: Any

    def lookup(self, upstream_name: str | None) -> ToolInfo | None:
        return self.by_upstream_name.get(upstream_name) if upstream_name else None

    def find(self, name: str, namespace: str | None = None) -> ToolInfo | None:
        for info in self.by_upstream_name.values():
            if info.name == name and info.namespace == namespace:
                return info
        return None

    def to_upstream_name(self, name: str, namespace: str | None) -> str:
        info = self.find(name, namespace)
        if info is not None:
            return info.upstream_name
        return flat_name(namespace, name) if namespace else name

    @property
    def callable_tools(self) -> tuple[ToolInfo, ...]:
        return tuple(self.by_upstream_name.values())

    @property
    def pinned_tools(self) -> tuple[ToolInfo, ...]:
        """The tools a call must come from when ``tool_choice`` demands a call; () when it does not."""
        choice = self.tool_choice
        if choice == "required":
            return self._allowed()
        if isinstance(choice, dict):
            ctype = choice.get("type")
            if ctype in CALLABLE_TYPES:
                info = self._named(choice)
                return (info,) if info else ()
            if ctype == "allowed_tools" and choice.get("mode") == "required":
                return self._allowed()
        return ()

    def _allowed(self) -> tuple[ToolInfo, ...]:
        names = self.allowed_upstream_names
        return tuple(i for i in self.by_upstream_name.values() if names is None or i.upstream_name in names)

    def _named(self, choice: Mapping[str, Any]) -> ToolInfo | None:
        return _resolve_named(self.by_upstream_name, choice)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary, for storage."""
        return {
            "initial_tools": [dict(t) for t in self.initial_tools],
            "effective_tools": [dict(t) for t in self.effective_tools],
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": {k: {"kind": v.kind, "name": v.name, "namespace": v.namespace}
                      for k, v in self.by_upstream_name.items()},
        }


def flat_name(namespace: str, member: str) -> str:
    """Deterministic upstream name of a namespace member, within vLLM's 64-character limit."""
    name = f"{namespace}__{member}"
    if len(name) <= UPSTREAM_NAME_LIMIT:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    room = UPSTREAM_NAME_LIMIT - len(digest) - 3  # two "__" separators... and one "_"
    ns_part = namespace[: max(8, room // 3)]
    member_part = member[: room - len(ns_part)]
    return f"{ns_part}__{member_part}_{digest}"


def _err(message: str, param: str, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code or "invalid_value")


def _check_tool(tool: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(tool, dict):
        raise _err("Each tool must be an object.", param, "invalid_type")
    ttype = tool.get("type")
    if not isinstance(ttype, str):
        raise _err("Each tool needs a string 'type'.", f"{param}.type", "missing_required_parameter")
    if ttype in CALLABLE_TYPES or ttype == "namespace":
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _err(f"A '{ttype}' tool needs a non-empty string 'name'.", f"{param}.name",
                       "missing_required_parameter")
        if ttype in CALLABLE_TYPES and not _VALID_NAME.match(name):
            raise _err(f"Invalid tool name '{name}': it must match ^[a-zA-Z0-9_-]+$.", f"{param}.name")
    if ttype == "custom":
        fmt = tool.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
                raise _err(f"Custom tool '{tool.get('name')}' has an invalid format: expected type "
                           "'text' or 'grammar'.", f"{param}.format")
            if fmt.get("type") == "grammar" and (
                fmt.get("syntax") not in ("lark", "regex") or not isinstance(fmt.get("definition"), str)
            ):
                raise _err(f"Custom tool '{tool.get('name')}' has a grammar format without a valid 'syntax' "
                           "(lark or regex) and string 'definition'.", f"{param}.format")
    if ttype == "function":
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _err(f"Function tool '{tool.get('name')}' has 'parameters' that is not an object.",
                       f"{param}.parameters", "invalid_type")
    if ttype == "namespace":
        members = tool.get("tools")
        if not isinstance(members, list) or not members:
            raise _err(f"Namespace '{tool.get('name')}' needs a non-empty 'tools' array.", f"{param}.tools")
        for j, member in enumerate(members):
            _check_tool(member, f"{param}.tools[{j}]")
            if member.get("type") not in CALLABLE_TYPES:
                raise _err(f"Namespace '{tool.get('name')}' may only contain function and custom tools.",
                           f"{param}.tools[{j}].type")
    return tool


def _dynamic_tools(body: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], str]]:
    items = body.get("input")
    found: list[tuple[Mapping[str, Any], str]] = []
    if not isinstance(items, list):
        return found
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("role") != "developer" or "tools" not in item:
            continue
        if item.get("type", "message") != "message":
            continue
        tools = item["tools"]
        if not isinstance(tools, list):
            raise _err("A developer message's 'tools' must be an array.", f"input[{i}].tools", "invalid_type")
        for j, tool in enumerate(tools):
            param = f"input[{i}].tools[{j}]"
            _check_tool(tool, param)
            if tool.get("type") not in (*CALLABLE_TYPES, "namespace"):
                raise _err("A developer message may declare only function, custom or namespace tools.",
                           f"{param}.type")
            found.append((tool, param))
    return found


def _resolve_named(by_upstream: Mapping[str, ToolInfo], choice: Mapping[str, Any]) -> ToolInfo | None:
    name, namespace = choice.get("name"), choice.get("namespace")
    exact = [i for i in by_upstream.values() if i.name == name and i.namespace == namespace]
    if exact:
        return exact[0]
    if namespace is None:
        # vLLM's rule: a bare name that matches exactly one namespace member names that member.
        members = [i for i in by_upstream.values() if i.name == name and i.namespace is not None]
        if len(members) == 1:
            return members[0]
    return None


def resolve_tool_context(body: Mapping[str, Any]) -> ResolvedToolContext:
    raw_tools = body.get("tools")
    if raw_tools is None:
        raw_tools = []
    if not isinstance(raw_tools, list):
        raise _err("'tools' must be an array.", "tools", "invalid_type")
    declared: list[tuple[Mapping[str, Any], str]] = [
        (_check_tool(t, f"tools[{i}]"), f"tools[{i}]") for i, t in enumerate(raw_tools)
    ]
    declared += _dynamic_tools(body)

    by_upstream: dict[str, ToolInfo] = {}
    public_seen: dict[tuple[str | None, str], str] = {}
    others: list[Mapping[str, Any]] = []

    def register(tool: Mapping[str, Any], param: str, namespace: str | None) -> None:
        name = tool["name"]
        key = (namespace, name)
        if key in public_seen:
            where = f"namespace '{namespace}'" if namespace else "this request"
            raise _err(f"Duplicate tool name '{name}' in {where}: it is declared at {public_seen[key]} and "
                       f"{param}.", f"{param}.name", "duplicate_tool_name")
        public_seen[key] = param
        upstream = flat_name(namespace, name) if namespace else name
        if upstream in by_upstream:
            clash = by_upstream[upstream]
            raise _err(f"Tool '{name}'{' in namespace ' + repr(namespace) if namespace else ''} maps to the "
                       f"upstream function name '{upstream}', which tool '{clash.name}' already uses.",
                       f"{param}.name", "duplicate_tool_name")
        by_upstream[upstream] = ToolInfo(tool["type"], name, upstream, namespace, tool)

    for tool, param in declared:
        ttype = tool["type"]
        if ttype in CALLABLE_TYPES:
            register(tool, param, None)
        elif ttype == "namespace":
            for j, member in enumerate(tool["tools"]):
                register(member, f"{param}.tools[{j}]", tool["name"])
        else:
            others.append(tool)

    has_tools = bool(by_upstream or others)
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise _err("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls", "invalid_type")

    given = "tool_choice" in body and body["tool_choice"] is not None
    choice = body.get("tool_choice") if given else ("auto" if has_tools else "none")
    allowed, upstream_choice = _resolve_choice(choice, given, has_tools, by_upstream)

    return ResolvedToolContext(
        initial_tools=tuple(raw_tools),
        effective_tools=tuple(t for t, _ in declared),
        tool_choice=choice,
        tool_choice_given=given,
        parallel_tool_calls=True if ptc is None else ptc,
        parallel_tool_calls_given=ptc is not None,
        by_upstream_name=MappingProxyType(by_upstream),
        other_tools=tuple(others),
        allowed_upstream_names=allowed,
        upstream_tool_choice=upstream_choice,
    )


def _resolve_choice(
    choice: Any, given: bool, has_tools: bool, by_upstream: Mapping[str, ToolInfo]
) -> tuple[frozenset[str] | None, Any]:
    """Validate ``tool_choice``; return the upstream tool-name filter and the upstream tool_choice."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _err(f"Invalid tool_choice '{choice}': expected 'none', 'auto', 'required' or an object.",
                       "tool_choice")
        if given and choice in ("auto", "required") and not has_tools:
            raise _err(f"tool_choice '{choice}' requires at least one tool, but the request declares none.",
                       "tool_choice")
        return None, choice
    if not isinstance(choice, dict):
        raise _err("'tool_choice' must be a string or an object.", "tool_choice", "invalid_type")
    ctype = choice.get("type")
    if ctype in CALLABLE_TYPES:
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise _err(f"tool_choice of type '{ctype}' needs a 'name'.", "tool_choice.name",
                       "missing_required_parameter")
        info = _resolve_named(by_upstream, choice)
        if info is None:
            raise _err(f"tool_choice names the {ctype} tool '{name}', which is not among the declared tools.",
                       "tool_choice.name", "tool_not_found")
        if info.kind != ctype:
            raise _err(f"tool_choice asks for a {ctype} tool, but '{name}' is declared as a {info.kind} "
                       "tool.", "tool_choice.type")
        return None, {"type": "function", "name": info.upstream_name}
    if ctype == "allowed_tools":
        mode = choice.get("mode")
        if mode not in ("auto", "required"):
            raise _err(f"Invalid allowed_tools mode {mode!r}: expected 'auto' or 'required'.",
                       "tool_choice.mode")
        entries = choice.get("tools")
        if not isinstance(entries, list) or not entries:
            raise _err("allowed_tools needs a non-empty 'tools' array.", "tool_choice.tools")
        names: set[str] = set()
        for j, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise _err("Each allowed_tools entry must be an object.", f"tool_choice.tools[{j}]",
                           "invalid_type")
            etype = entry.get("type")
            if etype in CALLABLE_TYPES:
                info = _resolve_named(by_upstream, entry)
                if info is None or info.kind != etype:
                    raise _err(f"allowed_tools names the {etype} tool '{entry.get('name')}', which is not "
                               "declared.", f"tool_choice.tools[{j}]", "tool_not_found")
                names.add(info.upstream_name)
            elif etype == "namespace":
                members = [i for i in by_upstream.values() if i.namespace == entry.get("name")]
                if not members:
                    raise _err(f"allowed_tools names the namespace '{entry.get('name')}', which is not "
                               "declared.", f"tool_choice.tools[{j}]", "tool_not_found")
                names.update(i.upstream_name for i in members)
            # Hosted tools (mcp, image_generation, ...) never reach the upstream as functions.
        return frozenset(names), mode
    # Hosted or newer choices: passed through untouched.
    return None, choice
