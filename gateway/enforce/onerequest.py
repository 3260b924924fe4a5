"""Grammar custom tools under ``tool_choice: auto`` enforced by the upstream request itself (issue 18). Pure.

The takeover (gateway.engine.takeover) keeps a grammar call live and valid by aborting the upstream stream when
the call opens and generating its input again in a second, constrained request: two requests per call and a lost
connection. vLLM 0.32 can constrain the call inside the first request, in one of two ways:

* **structural tag** (``--tool-call-parser hermes|qwen3_coder|qwen3_xml``): the gateway sends
  ``structured_outputs: {"structural_tag": …}`` with a ``triggered_tags`` format whose tags are the exact openings
  of the parser's call format, one per tool of the request (a function's content is its JSON schema; a grammar
  tool's content is its grammar as xgrammar EBNF — JSON-escaped inside hermes' JSON arguments, raw inside
  qwen3_coder's XML parameter). Text outside a call stays free. Every tool goes upstream *non-strict*: vLLM ORs
  its own strict-tool tag with the request's (``_apply_structural_tag``), and a strict tool whose ``input`` is a
  bare string would reopen an unconstrained path to the same call.
* **strict pattern** (``--tool-call-parser auto``, the default): the gateway cannot know the call format (a tag
  for the wrong one would turn every call into text), so it lets vLLM build its own strict-tool tag: the custom
  tool's function stays ``strict: true`` and its ``input`` gets ``"pattern": to_json_pattern(grammar)`` (over the
  JSON-escaped text, which is what xgrammar matches a string's pattern against in JSON-argument formats; an
  XML-parameter format (qwen3_coder) matches it against the raw value: such a server needs its named parser here,
  or its calls fail the end-of-call check and close ``incomplete``). Only regular
  grammars have a pattern (Codex's ``apply_patch`` has); the others stay with the takeover.

A grammar that cannot be converted, a request carrying its own structured output (``text.format`` or
``structured_outputs``: the two constraints would fight), or an upstream that cannot take these requests
(gateway.engine.grammar_routes decides from vLLM's ``GET /version``) leaves that tool with the takeover.

Decision table (per grammar tool; ``validate`` and ``off`` never change the request):

======================  ===========================  =====================================
parser                  grammar converts             route
======================  ===========================  =====================================
hermes, qwen3_coder/xml to EBNF                      ``structural_tag``
auto                    to a regular expression      ``strict_pattern``
any                     no / upstream cannot         ``takeover``
======================  ===========================  =====================================
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.translate.grammar_convert import GrammarConversionError
from gateway.translate.rewrite import INPUT_PARAM_SCHEMA
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo

__all__ = ["PARSERS", "ROUTES", "GrammarRoutes", "Route", "grammar_routes"]

Route = Literal["structural_tag", "strict_pattern", "takeover", "validate"]
ROUTES: tuple[Route, ...] = ("structural_tag", "strict_pattern", "takeover", "validate")

# vLLM's --tool-call-parser names the gateway knows the call format of (and "auto": not known).
PARSERS = ("auto", "hermes", "qwen3_coder", "qwen3_xml")

ToEbnf = Callable[[str, str, bool], str]
ToRegex = Callable[[str, str], str]  # grammar_convert.to_json_pattern
OnFailure = Callable[[ToolInfo, str], None]  # (tool, form "ebnf"|"regex"): reported by the engine, once


@dataclass(frozen=True, slots=True)
class _Format:
    """One call format of a vLLM tool parser: the trigger and, per tool, the exact begin/end around its content."""

    trigger: str
    # (begin prefix before the name, after the name, end) for function arguments
    envelopes: tuple[tuple[str, str, str], ...]
    json_arguments: bool  # hermes: arguments are a JSON object; qwen3: XML parameters (raw text)


_HERMES = _Format("<tool_call>", (
    # vLLM's own hermes tag (structural_tag_registry._hermes_tool_tags) accepts both layouts.
    ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    ('<tool_call>{"name": "', '", "arguments": ', "}</tool_call>"),
), json_arguments=True)
_QWEN3 = _Format("<tool_call>\n<function=", (
    ("<tool_call>\n<function=", ">\n", "\n</function>\n</tool_call>"),
), json_arguments=False)
FORMATS: dict[str, _Format] = {"hermes": _HERMES, "qwen3_coder": _QWEN3, "qwen3_xml": _QWEN3}


@dataclass
class GrammarRoutes:
    """What one request does with its grammar tools: each tool's route, and the changes to the upstream body."""

    routes: dict[str, Route] = field(default_factory=dict)  # upstream tool name -> route
    structural_tag: dict[str, Any] | None = None
    # upstream tool name -> replacement (parameters, strict) for the tool as sent upstream
    tools: dict[str, tuple[Mapping[str, Any], bool]] = field(default_factory=dict)
    unstrict_all: bool = False  # structural tag: every tool non-strict (see the module docstring)

    @property
    def one_request(self) -> frozenset[str]:
        return frozenset(n for n, r in self.routes.items() if r in ("structural_tag", "strict_pattern"))

    @property
    def takeover(self) -> frozenset[str]:
        return frozenset(n for n, r in self.routes.items() if r == "takeover")

    @property
    def used(self) -> tuple[Route, ...]:
        """The routes this request used, each once (the metric's values)."""
        return tuple(r for r in ROUTES if r in self.routes.values())

    @property
    def changes_body(self) -> bool:
        return self.structural_tag is not None or bool(self.tools)

    def apply(self, up: MutableMapping[str, Any]) -> None:
        """Change an upstream body (Responses' flat tools or Chat Completions' nested ones) in place."""
        if not self.changes_body:
            return
        tools = up.get("tools")
        if isinstance(tools, list):
            up["tools"] = [self._tool(t) for t in tools]
        if self.structural_tag is not None:
            up["structured_outputs"] = {"structural_tag": orjson.dumps(self.structural_tag).decode()}

    def _tool(self, tool: Any) -> Any:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return tool
        nested = isinstance(tool.get("function"), dict)
        fn = dict(tool["function"]) if nested else dict(tool)
        new = self.tools.get(str(fn.get("name")))
        if new is not None:
            fn["parameters"], fn["strict"] = new
        if self.unstrict_all and "strict" in fn:
            fn["strict"] = False
        return {"type": "function", "function": fn} if nested else fn


def _own_structured_output(body: Mapping[str, Any]) -> bool:
    if body.get("structured_outputs") is not None:
        return True
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return isinstance(fmt, dict) and fmt.get("type") not in (None, "text")


def _pattern_schema(pattern: str) -> dict[str, Any]:
    schema = copy.deepcopy(INPUT_PARAM_SCHEMA)
    schema["properties"]["input"]["pattern"] = pattern
    return schema


def grammar_routes(ctx: ResolvedToolContext, body: Mapping[str, Any], *, mode: str, parser: str, capable: bool,
                   to_ebnf: ToEbnf, to_regex: ToRegex, on_failure: OnFailure) -> GrammarRoutes:
    """Each grammar tool's route for this request (see the module docstring's table)."""
    allowed = ctx.allowed_upstream_names
    offered = [i for i in ctx.callable_tools if allowed is None or i.upstream_name in allowed]
    grammar_tools = [i for i in offered if i.grammar is not None]
    out = GrammarRoutes()
    if not grammar_tools or ctx.upstream_tool_choice == "none":
        return out
    if mode != "constrain":
        out.routes = {i.upstream_name: "validate" for i in grammar_tools}
        return out
    out.routes = {i.upstream_name: "takeover" for i in grammar_tools}
    if not capable or ctx.upstream_tool_choice != "auto" or _own_structured_output(body):
        return out
    fmt = FORMATS.get(parser)
    if fmt is None:  # auto: vLLM's own strict-tool tag, where the grammar has a pattern
        for info in grammar_tools:
            syntax, definition = info.grammar or ("", "")
            try:
                pattern = to_regex(syntax, definition)
            except GrammarConversionError:
                on_failure(info, "regex")
                continue
            out.routes[info.upstream_name] = "strict_pattern"
            out.tools[info.upstream_name] = (_pattern_schema(pattern), True)
        return out
    tags: list[dict[str, Any]] = []
    for info in offered:
        tags += _tags(fmt, info, to_ebnf, on_failure, out)
    out.structural_tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
        "at_least_one": False, "stop_after_first": not ctx.parallel_tool_calls}}
    out.unstrict_all = True
    return out


def _schema(info: ToolInfo) -> Any:
    if info.kind == "custom":
        return INPUT_PARAM_SCHEMA
    params = info.definition.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _tags(fmt: _Format, info: ToolInfo, to_ebnf: ToEbnf, on_failure: OnFailure, out: GrammarRoutes
          ) -> list[dict[str, Any]]:
    name = info.upstream_name
    grammar = info.grammar
    content: dict[str, Any] | None = None
    if grammar is not None:
        try:
            content = {"type": "grammar", "grammar": to_ebnf(grammar[0], grammar[1], fmt.json_arguments)}
        except GrammarConversionError:
            on_failure(info, "ebnf")  # stays "takeover": its call opens under the plain schema below
    tags = []
    for prefix, mid, end in fmt.envelopes:
        if content is not None and fmt.json_arguments:  # {"input": "<JSON-escaped text>"}
            tags.append({"type": "tag", "begin": f'{prefix}{name}{mid}{{"input": "', "content": content,
                         "end": f'"}}{end}'})
        elif content is not None:  # <parameter=input>\n<raw text>\n</parameter>
            tags.append({"type": "tag", "begin": f"{prefix}{name}{mid}<parameter=input>\n", "content": content,
                         "end": f"\n</parameter>{end}"})
        else:
            schema: dict[str, Any] = {"type": "json_schema", "json_schema": _schema(info)}
            if not fmt.json_arguments:
                schema["style"] = "qwen_xml"
            tags.append({"type": "tag", "begin": f"{prefix}{name}{mid}", "content": schema, "end": end})
    if content is not None:
        out.routes[name] = "structural_tag"
    return tags
