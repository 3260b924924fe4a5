"""Does a call satisfy its tool? JSON Schema for functions, Lark or a regex for grammar custom tools. Pure.

``check_call`` answers one call; ``check_pinned_output`` answers a whole output against ``tool_choice``
(``required``, a named tool, ``allowed_tools`` required): at least one call, every call of an allowed
tool, every call valid.

Lark: Python's ``lark`` refuses terminals that can match the empty string (``/[^\\n]*/``), which vLLM's
grammar backends accept. ``load_lark`` rewrites such a rule-level terminal ``/X*/`` into the equivalent
``/X+/?`` and retries; a grammar it still cannot load is reported as unchecked (never as a violation:
the gateway does not blame the model for its own parser's limits).

Parsers: LALR first (linear, tens of times faster than Earley on a long patch: 14 ms against 0.5 s for
64 KB of Codex's apply_patch), Earley when the grammar is not LALR(1) (a conflict, a load error). An LALR
parse that succeeds is a derivation of the input, so Earley accepts it too; one that fails may come from
LALR's limits (a shift/reduce conflict resolved as a shift, a greedy contextual lexer), so a rejection is
confirmed with Earley before it counts. Verdicts are therefore Earley's, at LALR's cost on the common path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.translate.builtin_tools import builtin_arguments, builtin_tool_of, v4a_problem
from gateway.translate.lark_rewrite import foreign_import
from gateway.translate.lark_rewrite import rewrite_zero_width as _rewrite_zero_width
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo

if TYPE_CHECKING:
    import lark

# jsonschema and lark are imported where they are used: together they cost several MB of RSS in every
# gateway process, and only requests that enforce a tool_choice or a grammar need them.

__all__ = ["CallCheck", "LarkChecker", "OutputCheck", "check_call", "check_input", "check_pinned_output",
           "load_lark"]

@dataclass(frozen=True, slots=True)
class LarkChecker:
    parser: lark.Lark | None
    rewritten: bool = False
    error: str | None = None  # why the grammar could not be loaded (then parser is None)
    grammar: str | None = None  # the text that loaded (after the rewrite): an LALR rejection is confirmed on it

    def check(self, text: str) -> str | None:
        """None if ``text`` parses; otherwise a short reason."""
        if self.parser is None:
            return None
        import lark

        try:
            self.parser.parse(text)
        except lark.exceptions.LarkError as exc:
            if self.grammar is not None and self.parser.options.parser == "lalr" and _earley_accepts(self.grammar,
                                                                                                    text):
                return None
            # Lark's messages quote the offending input; a tool input never reaches the logs, so only the
            # error kind and its position are kept.
            line, column = getattr(exc, "line", None), getattr(exc, "column", None)
            where = f" at line {line}, column {column}" if isinstance(line, int) and line > 0 else ""
            return f"does not match the Lark grammar ({type(exc).__name__}{where})"
        return None


def _earley_accepts(grammar: str, text: str) -> bool:
    import lark

    parser = _earley(grammar)
    if parser is None:
        return False
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def _earley(grammar: str) -> lark.Lark | None:
    """Built only when an LALR parser rejected an input (a violation, the rare path)."""
    import lark

    try:
        return lark.Lark(grammar, parser="earley")
    except lark.exceptions.LarkError:
        return None


def _load(grammar: str) -> lark.Lark:
    """LALR if the grammar is LALR(1) for lark, else Earley (whose error, if it fails too, is raised)."""
    import lark

    try:
        return lark.Lark(grammar, parser="lalr")
    except lark.exceptions.LarkError:  # GrammarError (conflicts, collisions), LexError, ConfigurationError
        return lark.Lark(grammar, parser="earley")


@functools.lru_cache(maxsize=64)
def load_lark(definition: str) -> LarkChecker:
    foreign = foreign_import(definition)
    if foreign is not None:
        return LarkChecker(None, error=f"the grammar imports {foreign!r}, which the gateway does not load")
    try:
        return _load_lark(definition)
    except Exception as exc:  # lark raising something else (a missing regex module, ...): unchecked, not a 500
        return LarkChecker(None, error=f"the Python lark package cannot load this grammar ({type(exc).__name__})")


def _load_lark(definition: str) -> LarkChecker:
    import lark

    try:
        return LarkChecker(_load(definition), grammar=definition)
    except lark.exceptions.LarkError as exc:
        first_error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    rewritten = _rewrite_zero_width(definition)
    if rewritten != definition:
        try:
            return LarkChecker(_load(rewritten), rewritten=True, grammar=rewritten)
        except lark.exceptions.LarkError as exc:
            first_error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    return LarkChecker(None, error=f"the Python lark package cannot load this grammar ({first_error})")


@functools.lru_cache(maxsize=64)
def _regex(definition: str) -> re.Pattern[str] | None:
    try:
        return re.compile(definition)
    except re.error:
        return None


@dataclass(frozen=True, slots=True)
class CallCheck:
    ok: bool
    reason: str | None = None
    unchecked: str | None = None  # set when the tool's constraint could not be evaluated here


def check_input(info: ToolInfo, value: str) -> CallCheck:
    """A custom tool's raw input against its format."""
    grammar = info.grammar
    if grammar is None:
        return CallCheck(True)
    syntax, definition = grammar
    if syntax == "regex":
        rx = _regex(definition)
        if rx is None:
            return CallCheck(True, unchecked="the tool's regex does not compile in Python")
        if rx.fullmatch(value) is None:
            return CallCheck(False, f"input of '{info.name}' does not fully match its regex")
        return CallCheck(True)
    checker = load_lark(definition)
    if checker.parser is None:
        return CallCheck(True, unchecked=checker.error)
    reason = checker.check(value)
    return CallCheck(reason is None, f"input of '{info.name}' {reason}" if reason else None)


def check_arguments(info: ToolInfo, arguments: str) -> CallCheck:
    """A function call's arguments: strict JSON (no NaN/Infinity), an object, valid against the schema."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return CallCheck(False, f"arguments of '{info.name}' are not valid JSON")
    if not isinstance(value, dict):
        return CallCheck(False, f"arguments of '{info.name}' are not a JSON object")
    schema = info.definition.get("parameters")
    if not isinstance(schema, dict):
        return CallCheck(True)
    import jsonschema

    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return CallCheck(True, unchecked=f"the parameters schema is invalid ({exc.message[:120]})")
    except Exception as exc:  # a client schema jsonschema chokes on ($schema: 5, ...): unchecked, never a 500
        return CallCheck(True, unchecked=f"the parameters schema cannot be used ({type(exc).__name__})")
    try:
        error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(value))
    except Exception as exc:  # dangling, looping or remote $refs: the gateway does not fetch or recurse forever
        return CallCheck(True, unchecked=f"the parameters schema cannot be evaluated ({type(exc).__name__})")
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        # jsonschema's message quotes the value; only the failed keyword is kept (arguments never reach the logs).
        return CallCheck(False, f"arguments of '{info.name}' do not match its schema at {where} "
                                f"(keyword '{error.validator}')")
    if info.kind == "apply_patch":  # the diff is V4A (checked on the complete call; constrain's retries use it too)
        operation = value.get("operation")
        problem = v4a_problem(operation if isinstance(operation, dict) else {})
        if problem is not None:
            return CallCheck(False, problem)
    return CallCheck(True)


def check_call(item: Mapping[str, Any], ctx: ResolvedToolContext) -> tuple[ToolInfo | None, CallCheck]:
    """One client output item (function_call, custom_tool_call or a built-in call) against its declared tool."""
    builtin = builtin_tool_of(item)
    if builtin is not None:  # apply_patch_call / shell_call / local_shell_call: its payload as the arguments
        info = next((i for i in ctx.callable_tools if i.kind == builtin), None)
        if info is None:
            return None, CallCheck(False, f"'{builtin}' is not a declared tool")
        if item.get("status") not in (None, "completed"):
            return info, CallCheck(False, f"the {builtin} call was cut off before its arguments were complete")
        return info, check_arguments(info, builtin_arguments(item))
    info = ctx.find(str(item.get("name")), item.get("namespace"))
    if info is None:
        return None, CallCheck(False, f"'{item.get('name')}' is not a declared tool")
    if item.get("type") == "custom_tool_call":
        if info.kind != "custom":
            return info, CallCheck(False, f"'{info.name}' is not a custom tool")
        return info, check_input(info, str(item.get("input", "")))
    if info.kind != "function":
        return info, CallCheck(False, f"'{info.name}' is a custom tool but came back as a function call")
    return info, check_arguments(info, str(item.get("arguments", "")))


@dataclass(frozen=True, slots=True)
class OutputCheck:
    ok: bool
    reason: str | None = None
    unchecked: tuple[str, ...] = ()


def check_pinned_output(output: Sequence[Any], ctx: ResolvedToolContext, status: str | None = None) -> OutputCheck:
    """The output of a request whose ``tool_choice`` demands a call from ``ctx.pinned_tools``."""
    pinned = {(i.name, i.namespace) for i in ctx.pinned_tools}
    calls = [i for i in output if isinstance(i, dict) and (i.get("type") in ("function_call", "custom_tool_call")
                                                           or builtin_tool_of(i) is not None)]
    cut = " (the upstream stopped at its token limit)" if status == "incomplete" else ""
    if not calls:
        return OutputCheck(False, f"tool_choice requires a tool call, but the upstream answered without one{cut}.")
    unchecked: list[str] = []
    for item in calls:
        builtin = builtin_tool_of(item)
        if builtin is not None:
            if (builtin, None) not in pinned:
                return OutputCheck(False, f"the upstream called '{builtin}', which tool_choice does not allow.")
        elif (item.get("name"), item.get("namespace")) not in pinned:
            return OutputCheck(False, f"the upstream called '{item.get('name')}', which tool_choice does not allow.")
        _, verdict = check_call(item, ctx)
        if not verdict.ok:
            return OutputCheck(False, f"{verdict.reason}{cut}.")
        if verdict.unchecked:
            unchecked.append(verdict.unchecked)
    return OutputCheck(True, unchecked=tuple(unchecked))
