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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from gateway.errors import InvalidRequest
from gateway.translate.builtin_tools import BUILTIN_TOOL_TYPES, builtin_function

ToolKind = Literal["function", "custom", "mcp", "web_search", "other", "apply_patch", "shell", "local_shell"]

UPSTREAM_NAME_LIMIT = 64
_VALID_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
CALLABLE_TYPES = ("function", "custom")
# OpenAI's web search tool types (and tool_choice types): run by the gateway when a provider is configured.
WEB_SEARCH_TYPES = frozenset({"web_search", "web_search_2025_08_26", "web_search_preview",
                              "web_search_preview_2025_03_11"})


def is_web_search(value: Any) -> bool:
    """Whether a tool's (or a tool_choice's) ``type`` is a web search type; any JSON value may come in."""
    return isinstance(value, str) and value in WEB_SEARCH_TYPES


__all__ = [
    "WEB_SEARCH_TYPES",
    "ResolvedToolContext",
    "ToolInfo",
    "flat_name",
    "is_web_search",
    "public_tool",
    "resolve_tool_context",
    "with_mcp_tools",
    "with_web_search",
]
_LABEL = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


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
    # Remote MCP servers (``{"type":"mcp",…}``) the gateway runs itself; never sent upstream as such.
    mcp_tools: tuple[Mapping[str, Any], ...] = ()

    @property
    def server_label_of(self) -> Mapping[str, str]:
        return {i.upstream_name: str(i.definition.get("server_label")) for i in self.by_upstream_name.values()
                if i.kind == "mcp"}

    @property
    def web_search(self) -> ToolInfo | None:
        """The gateway-run search function (``with_web_search``), if this request has one."""
        return next((i for i in self.by_upstream_name.values() if i.kind == "web_search"), None)

    def mcp_server(self, label: str) -> Mapping[str, Any] | None:
        return next((t for t in self.mcp_tools if t.get("server_label") == label), None)

    def find_mcp(self, label: str, name: str) -> ToolInfo | None:
        for info in self.by_upstream_name.values():
            if info.kind == "mcp" and info.name == name and info.definition.get("server_label") == label:
                return info
        return None

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
        choice = _as_declared(self.tool_choice, self.by_upstream_name)
        if choice == "required":
            return self._allowed()
        if isinstance(choice, dict):
            ctype = choice.get("type")
            if ctype in CALLABLE_TYPES:
                info = self._named(choice)
                return (info,) if info else ()
            if ctype in BUILTIN_TOOL_TYPES:  # {"type": "apply_patch"}: pinned like a named function
                info = _builtin(self.by_upstream_name, ctype)
                return (info,) if info else ()
            # mcp and web_search: pinned like a named function (or required among that server's tools)
            if ctype == "mcp" or is_web_search(ctype):
                return self._allowed() if self.allowed_upstream_names is not None else ()
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
            "initial_tools": [public_tool(t) for t in self.initial_tools],
            "effective_tools": [public_tool(t) for t in self.effective_tools],
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": {k: {"kind": v.kind, "name": v.name, "namespace": v.namespace}
                      for k, v in self.by_upstream_name.items()},
        }


_SECRET_KEYS = ("headers", "authorization")


def public_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as it may be echoed or stored: an mcp tool's credentials go to its server only."""
    if tool.get("type") == "mcp" and any(k in tool for k in _SECRET_KEYS):
        return {k: v for k, v in tool.items() if k not in _SECRET_KEYS}
    return dict(tool)


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
    if ttype == "mcp":
        _check_mcp(tool, param)
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


def _check_mcp(tool: Mapping[str, Any], param: str) -> None:
    label = tool.get("server_label")
    if not isinstance(label, str) or not _LABEL.match(label):
        raise _err("An mcp tool needs a 'server_label' of letters, digits, '_' or '-' (at most 64).",
                   f"{param}.server_label", "missing_required_parameter" if label is None else "invalid_value")
    for key in ("server_url", "server_description", "authorization"):
        if tool.get(key) is not None and not isinstance(tool.get(key), str):
            raise _err(f"The mcp tool's '{key}' must be a string.", f"{param}.{key}", "invalid_type")
    headers = tool.get("headers")
    if headers is not None and (not isinstance(headers, dict)
                                or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
        raise _err("The mcp tool's 'headers' must be an object of strings.", f"{param}.headers", "invalid_type")
    allowed = tool.get("allowed_tools")
    names = allowed.get("tool_names") if isinstance(allowed, dict) else allowed
    if allowed is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise _err("'allowed_tools' must be a list of tool names or {\"tool_names\": [...]}.",
                   f"{param}.allowed_tools", "invalid_type")
    policy = tool.get("require_approval")
    if policy is not None and policy not in ("always", "never"):
        ok = isinstance(policy, dict) and set(policy) <= {"always", "never"} and all(
            isinstance(v, dict) and isinstance(v.get("tool_names", []), list) for v in policy.values())
        if not ok:
            raise _err("'require_approval' must be 'always', 'never' or {\"always\": {\"tool_names\": […]}, "
                       "\"never\": {\"tool_names\": […]}}.", f"{param}.require_approval")


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
    mcp: list[Mapping[str, Any]] = []

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
        elif ttype in BUILTIN_TOOL_TYPES:
            # Client-executed built-in tools: a function named after the type (a client function of the same
            # name is a duplicate_tool_name 400). strict: the same rule as custom tools' functions (rewrite.py).
            register({**builtin_function(ttype, strict=True), "type": ttype}, param, None)
        elif ttype == "namespace":
            for j, member in enumerate(tool["tools"]):
                register(member, f"{param}.tools[{j}]", tool["name"])
        elif ttype == "mcp":
            if any(m["server_label"] == tool["server_label"] for m in mcp):
                raise _err(f"Duplicate mcp server_label '{tool['server_label']}'.", f"{param}.server_label",
                           "duplicate_tool_name")
            mcp.append(tool)
        else:
            others.append(tool)

    has_tools = bool(by_upstream or others or mcp)
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise _err("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls", "invalid_type")

    given = "tool_choice" in body and body["tool_choice"] is not None
    choice = body.get("tool_choice") if given else ("auto" if has_tools else "none")
    labels = frozenset(str(m["server_label"]) for m in mcp)
    allowed, upstream_choice = _resolve_choice(_as_declared(choice, by_upstream), given, has_tools, by_upstream,
                                               labels, listed=False)

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
        mcp_tools=tuple(mcp),
    )


def with_mcp_tools(ctx: ResolvedToolContext, listed: Mapping[str, Sequence[Mapping[str, Any]]]) -> ResolvedToolContext:
    """The context once the MCP servers' tools are known: each listed tool (already filtered by
    ``allowed_tools``) becomes an upstream function of kind ``mcp``, and ``tool_choice`` is resolved
    against them. ``listed`` maps a server label to its tools (``name``, ``description``, ``input_schema``)."""
    from gateway.translate.mcp_items import mcp_name, tool_function  # mcp_items imports nothing from here

    by_upstream = dict(ctx.by_upstream_name)
    for label, tools in listed.items():
        server = ctx.mcp_server(label)
        if server is None:
            continue
        for tool in tools:
            name = str(tool.get("name"))
            upstream = mcp_name(label, name)
            if upstream in by_upstream:
                raise _err(f"The MCP tool '{name}' of server '{label}' maps to the upstream function name "
                           f"'{upstream}', which another tool already uses.", "tools", "duplicate_tool_name")
            definition = {**tool_function(upstream, tool, server), "server_label": label}
            by_upstream[upstream] = ToolInfo("mcp", name, upstream, None, definition)
    labels = frozenset(str(m["server_label"]) for m in ctx.mcp_tools)
    allowed, upstream_choice = _resolve_choice(_as_declared(ctx.tool_choice, by_upstream), ctx.tool_choice_given,
                                               True, by_upstream, labels, listed=True)
    return replace(ctx, by_upstream_name=MappingProxyType(by_upstream), allowed_upstream_names=allowed,
                   upstream_tool_choice=upstream_choice)


def with_web_search(ctx: ResolvedToolContext) -> ResolvedToolContext:
    """The context when the gateway runs web search (a provider is configured): the request's first
    ``web_search``/``web_search_preview`` tool becomes an upstream function of kind ``web_search`` under a name no
    client tool uses (gateway.translate.web_search), no longer passed upstream as a hosted tool; a
    ``tool_choice`` of that type pins it like a named function. Without such a tool: ``ctx`` unchanged."""
    from gateway.translate.web_search import search_function, search_function_name  # imports nothing from here

    tools = [t for t in ctx.other_tools if is_web_search(t.get("type"))]
    if not tools:
        return ctx
    by_upstream = dict(ctx.by_upstream_name)
    name = search_function_name(by_upstream)
    by_upstream[name] = ToolInfo("web_search", name, name, None,
                                 {**search_function(name), "web_search_tool": tools[0]})
    labels = frozenset(str(m["server_label"]) for m in ctx.mcp_tools)
    allowed, upstream_choice = _resolve_choice(_as_declared(ctx.tool_choice, by_upstream), ctx.tool_choice_given,
                                               True, by_upstream, labels, listed=False)
    return replace(ctx, by_upstream_name=MappingProxyType(by_upstream),
                   other_tools=tuple(t for t in ctx.other_tools if not is_web_search(t.get("type"))),
                   allowed_upstream_names=allowed, upstream_tool_choice=upstream_choice)


# OpenAI's own tool types that clients send as tool_choice for a same-named tool they declared themselves: the
# Vercel AI SDK forces a custom tool named apply_patch with {"type": "apply_patch"}.
_BUILTIN_CHOICES = ("apply_patch", "shell")


def _builtin(by_upstream: Mapping[str, ToolInfo], kind: str) -> ToolInfo | None:
    """The declared built-in tool of this type (``apply_patch``, ``shell``, ``local_shell``), if any."""
    return next((i for i in by_upstream.values() if i.kind == kind and i.namespace is None), None)


def _as_declared(choice: Any, by_upstream: Mapping[str, ToolInfo]) -> Any:
    """``{"type": "apply_patch"}`` as ``{"type": <kind>, "name": "apply_patch"}`` when such a tool is declared."""
    if isinstance(choice, dict) and choice.get("type") in _BUILTIN_CHOICES and "name" not in choice:
        info = _resolve_named(by_upstream, {"name": choice["type"]})
        if info is not None and info.kind in CALLABLE_TYPES:
            return {"type": info.kind, "name": info.name}
    return choice


def _mcp_choice(entry: Mapping[str, Any], param: str, by_upstream: Mapping[str, ToolInfo], labels: frozenset[str],
                listed: bool) -> list[ToolInfo]:
    """The tools an ``{"type":"mcp","server_label":L,"name"?:N}`` choice names (all of L's without a name)."""
    label, name = entry.get("server_label"), entry.get("name")
    if not isinstance(label, str):
        raise _err("An mcp tool_choice needs a string 'server_label'.", f"{param}.server_label", "invalid_type")
    if label not in labels:
        raise _err(f"tool_choice names the MCP server '{label}', which is not among the declared tools.",
                   f"{param}.server_label", "tool_not_found")
    if name is not None and not isinstance(name, str):
        raise _err("An mcp tool_choice's 'name' must be a string.", f"{param}.name", "invalid_type")
    if not listed:
        return []
    found = [i for i in by_upstream.values() if i.kind == "mcp" and i.definition.get("server_label") == label
             and (name is None or i.name == name)]
    if not found:
        what = f"the tool '{name}'" if name else "any tool"
        raise _err(f"tool_choice asks for {what} of the MCP server '{label}', which did not list it.",
                   f"{param}.name" if name else f"{param}.server_label", "tool_not_found")
    return found


def _resolve_choice(
    choice: Any, given: bool, has_tools: bool, by_upstream: Mapping[str, ToolInfo],
    labels: frozenset[str] = frozenset(), *, listed: bool = True,
) -> tuple[frozenset[str] | None, Any]:
    """Validate ``tool_choice``; return the upstream tool-name filter and the upstream tool_choice.

    Before the MCP servers are listed (``listed=False``) an mcp choice is only checked for its label."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _err(f"Invalid tool_choice '{choice}': expected 'none', 'auto', 'required' or an object.",
                       "tool_choice")
        # "auto" without tools is accepted, as OpenAI does: Codex's own (local) compaction turn sends it.
        if given and choice == "required" and not has_tools:
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
    if ctype in BUILTIN_TOOL_TYPES and _builtin(by_upstream, ctype) is not None:
        return None, {"type": "function", "name": ctype}
    if ctype == "mcp":
        found = _mcp_choice(choice, "tool_choice", by_upstream, labels, listed)
        if not listed:
            return None, "auto"
        if len(found) == 1:
            return frozenset({found[0].upstream_name}), {"type": "function", "name": found[0].upstream_name}
        return frozenset(i.upstream_name for i in found), "required"
    if is_web_search(ctype):
        search = next((i for i in by_upstream.values() if i.kind == "web_search"), None)
        if search is None:  # no provider: passed upstream untouched, as before
            return None, choice
        return frozenset({search.upstream_name}), {"type": "function", "name": search.upstream_name}
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
            elif etype in BUILTIN_TOOL_TYPES and _builtin(by_upstream, etype) is not None:
                names.add(etype)
            elif etype == "mcp":
                names.update(i.upstream_name for i in _mcp_choice(entry, f"tool_choice.tools[{j}]", by_upstream,
                                                                  labels, listed))
            elif is_web_search(etype):
                names.update(i.upstream_name for i in by_upstream.values() if i.kind == "web_search")
            # Other hosted tools (image_generation, ...) never reach the upstream as functions.
        return frozenset(names), mode
    # Hosted or newer choices: passed through untouched.
    return None, choice
