"""OpenAI's client-executed built-in tools (``apply_patch``, ``shell``, ``local_shell``) over an upstream that
knows only functions. Pure: no I/O.

Like custom tools, these are client-owned: the model proposes, the client runs. vLLM is offered each one as a
function named after the tool type whose parameters mirror the call's payload (``operation`` for
``apply_patch``, ``action`` for ``shell`` and ``local_shell``); its function calls come back to the client as
``apply_patch_call`` / ``shell_call`` / ``local_shell_call`` items, and those items and their outputs in history
go upstream as the function call and its output again.

Streaming: an ``apply_patch_call`` is announced once its operation's ``type`` and ``path`` are known (the
schema lists them before ``diff``, and vLLM's strict decoding keeps that order); the diff is then streamed as
``response.apply_patch_call_operation_diff.delta`` events decoded from the argument deltas (``PatchStream``),
as OpenAI streams it and as the AI SDK reads it. Shell calls are announced at once and completed with their
action; OpenAI streams no argument events for them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.protocol.ids import custom_call_item_id
from gateway.translate.custom_input import InputDecoder

__all__ = [
    "BUILTIN_CALL_TYPES", "BUILTIN_OUTPUT_TYPES", "BUILTIN_TOOL_TYPES", "ITEM_ID_PREFIX", "PatchStream", "ShellStream",
    "builtin_arguments", "builtin_call_item", "builtin_function", "builtin_history", "builtin_tool_of", "opening_item",
    "v4a_problem",
]

BUILTIN_TOOL_TYPES = ("apply_patch", "shell", "local_shell")
# tool type -> the client's call item type
BUILTIN_CALL_TYPES = {"apply_patch": "apply_patch_call", "shell": "shell_call", "local_shell": "local_shell_call"}
BUILTIN_OUTPUT_TYPES = ("apply_patch_call_output", "shell_call_output", "local_shell_call_output")
# OpenAI's item id prefixes for these items.
ITEM_ID_PREFIX = {
    "apply_patch_call": "apc", "apply_patch_call_output": "apco",
    "shell_call": "sh", "shell_call_output": "sho",
    "local_shell_call": "lsh", "local_shell_call_output": "lsho",
}
_OPERATIONS = ("create_file", "update_file", "delete_file")

_V4A = (
    "Edit files with a V4A diff. `operation.type` is create_file, update_file or delete_file; `operation.path` "
    "is the file's path relative to the workspace root; `operation.diff` is the V4A diff (not for delete_file). "
    "For create_file every line of the new file is prefixed with '+'. For update_file write one or more hunks: "
    "an optional '@@ <line that locates the change>' header, then up to three lines of context prefixed with a "
    "space, the removed lines prefixed with '-', the added lines prefixed with '+', and context after."
)

_SCHEMAS: dict[str, dict[str, Any]] = {
    # Property order matters: type and path come before diff, so the call can be announced as the diff streams.
    "apply_patch": {
        "type": "object",
        "properties": {"operation": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": list(_OPERATIONS)},
                "path": {"type": "string"},
                "diff": {"type": "string"},
            },
            "required": ["type", "path"],
            "additionalProperties": False,
        }},
        "required": ["operation"],
        "additionalProperties": False,
    },
    "shell": {
        "type": "object",
        "properties": {"action": {
            "type": "object",
            "properties": {
                "commands": {"type": "array", "items": {"type": "string"}},
                "timeout_ms": {"type": "integer"},
                "max_output_length": {"type": "integer"},
            },
            "required": ["commands"],
            "additionalProperties": False,
        }},
        "required": ["action"],
        "additionalProperties": False,
    },
    "local_shell": {
        "type": "object",
        "properties": {"action": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
                "timeout_ms": {"type": "integer"},
                "working_directory": {"type": "string"},
                "user": {"type": "string"},
            },
            "required": ["command"],
            "additionalProperties": False,
        }},
        "required": ["action"],
        "additionalProperties": False,
    },
}

_DESCRIPTIONS = {
    "apply_patch": _V4A,
    "shell": "Run shell commands on the user's machine. `action.commands` are run in order, each as one shell "
             "command line; `timeout_ms` and `max_output_length` are optional limits.",
    "local_shell": "Run a command on the user's machine. `action.command` is the argv array (for example "
                   "[\"ls\", \"-la\"]); `env`, `timeout_ms`, `working_directory` and `user` are optional.",
}


def builtin_function(tool_type: str, *, strict: bool) -> dict[str, Any]:
    """The function vLLM is offered for a built-in tool (its name is the tool type)."""
    return {"type": "function", "name": tool_type, "description": _DESCRIPTIONS[tool_type],
            "parameters": _SCHEMAS[tool_type], "strict": strict}


# ----------------------------------------------------------------------------- upstream call -> client item


def _args(arguments: str) -> dict[str, Any] | None:
    """The arguments object; None when they are not one (cut off at the token limit, or not JSON)."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _operation(args: Mapping[str, Any]) -> dict[str, Any]:
    raw = args.get("operation")
    op = raw if isinstance(raw, dict) else args  # a model that left out the wrapper
    otype = op.get("type") if op.get("type") in _OPERATIONS else "update_file"
    out: dict[str, Any] = {"type": otype, "path": op.get("path") if isinstance(op.get("path"), str) else ""}
    if otype != "delete_file":
        out["diff"] = op.get("diff") if isinstance(op.get("diff"), str) else ""
    return out


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _action(tool_type: str, args: Mapping[str, Any]) -> dict[str, Any]:
    raw = args.get("action")
    action = raw if isinstance(raw, dict) else args
    if tool_type == "shell":
        return {"commands": _strings(action.get("commands")), "timeout_ms": _int_or_none(action.get("timeout_ms")),
                "max_output_length": _int_or_none(action.get("max_output_length"))}
    env = action.get("env")
    return {
        "type": "exec",
        "command": _strings(action.get("command")),
        "env": {k: v for k, v in env.items() if isinstance(v, str)} if isinstance(env, dict) else {},
        "timeout_ms": _int_or_none(action.get("timeout_ms")),
        "working_directory": action.get("working_directory") if isinstance(action.get("working_directory"), str)
        else None,
        "user": action.get("user") if isinstance(action.get("user"), str) else None,
    }


def item_id(item_type: str, upstream_item_id: str | None, call_id: str | None) -> str:
    """OpenAI's prefix + the upstream item id's suffix (stable across a stream and its body, as ``ctc_``)."""
    return ITEM_ID_PREFIX[item_type] + custom_call_item_id(upstream_item_id, call_id)[3:]


def _status(item_type: str, status: Any) -> str:
    if item_type == "apply_patch_call":  # OpenAI's apply_patch_call has no "incomplete"
        return "completed" if status == "completed" else "in_progress"
    return status if status in ("in_progress", "completed", "incomplete") else "completed"


def builtin_call_item(tool_type: str, item: Mapping[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """The client's item for an upstream function call of a built-in tool, from its complete arguments."""
    item_type = BUILTIN_CALL_TYPES[tool_type]
    args = _args(arguments if arguments is not None else str(item.get("arguments") or ""))
    # Arguments that do not parse were cut off: never "completed", so no client runs half a command or patch.
    status = item.get("status") if args is not None else "incomplete"
    args = args or {}
    out: dict[str, Any] = {"id": item_id(item_type, item.get("id"), item.get("call_id")), "type": item_type,
                           "call_id": item.get("call_id"), "status": _status(item_type, status)}
    if tool_type == "apply_patch":
        out["operation"] = _operation(args)
    else:
        out["action"] = _action(tool_type, args)
    return out


def opening_item(tool_type: str, item: Mapping[str, Any], operation: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The ``output_item.added`` form: in progress, the action empty (or the operation with an empty diff)."""
    out = builtin_call_item(tool_type, {**item, "status": "in_progress"}, "{}")
    if operation is not None:
        out["operation"] = dict(operation)
    return out


class PatchStream:
    """The diff of an ``apply_patch`` call as its argument JSON arrives, cut anywhere.

    Until the ``diff`` value starts, the head of the arguments is kept (at most ``limit`` characters: past that
    the call is only shown when complete); ``type`` and ``path`` are read from it. Then the diff's characters
    are decoded by the same JSON-string decoder custom tools use."""

    __slots__ = ("_head", "decoder", "gave_up", "limit", "operation")
    _DIFF = re.compile(r'(?<!\\)"diff"\s*:\s*"')
    _TYPE = re.compile(r'(?<!\\)"type"\s*:\s*"(create_file|update_file|delete_file)"')
    _PATH = re.compile(r'(?<!\\)"path"\s*:\s*"((?:[^"\\]|\\.)*)"')

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._head = ""
        self.operation: dict[str, Any] | None = None  # set when the call can be announced
        self.decoder: InputDecoder | None = None
        self.gave_up = False

    def feed(self, delta: str) -> str:
        """The diff characters this delta completes (announce the call first when ``operation`` just got set)."""
        if self.decoder is not None:
            return self.decoder.feed(delta)
        if self.gave_up:
            return ""
        self._head += delta
        m = self._DIFF.search(self._head)
        if m is None:
            if len(self._head) > self.limit:
                self.gave_up, self._head = True, ""
            return ""
        before = self._head[:m.start()]
        otype, path = self._TYPE.search(before), self._PATH.search(before)
        rest, self._head = self._head[m.end():], ""
        if otype is None or path is None:
            self.gave_up = True  # the diff came first: shown when complete
            return ""
        try:
            path_value = orjson.loads(f'"{path.group(1)}"')
        except orjson.JSONDecodeError:
            self.gave_up = True
            return ""
        self.operation = {"type": otype.group(1), "path": path_value, "diff": ""}
        self.decoder = InputDecoder()
        self.decoder.mode = "value"
        return self.decoder.feed(rest)

    @property
    def streamed(self) -> str:
        return self.decoder.value if self.decoder is not None else ""


class ShellStream:
    """The commands of a ``shell`` call as its argument JSON arrives: ``("added", i, "")``, ``("delta", i, text)``
    and ``("done", i, command)`` steps for each string of ``action.commands`` (OpenAI's
    ``response.shell_call_command.*`` events). The head before the array is kept up to ``limit`` characters."""

    __slots__ = ("_head", "decoder", "done", "index", "limit", "state")
    _COMMANDS = re.compile(r'(?<!\\)"commands"\s*:\s*\[')

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._head = ""
        self.state = "seek"  # seek | between | string | end | gave_up
        self.decoder: InputDecoder | None = None
        self.index = -1
        self.done: list[str] = []  # the commands completed so far

    def feed(self, delta: str) -> list[tuple[str, int, str]]:
        if self.state == "seek":
            self._head += delta
            m = self._COMMANDS.search(self._head)
            if m is None:
                if len(self._head) > self.limit:
                    self.state, self._head = "gave_up", ""
                return []
            delta, self._head, self.state = self._head[m.end():], "", "between"
        out: list[tuple[str, int, str]] = []
        i, n = 0, len(delta)
        while i < n and self.state in ("between", "string"):
            if self.state == "between":
                ch = delta[i]
                i += 1
                if ch in " \t\r\n,":
                    continue
                if ch == '"':
                    self.index += 1
                    self.decoder = InputDecoder()
                    self.decoder.mode = "value"
                    self.state = "string"
                    out.append(("added", self.index, ""))
                else:  # "]" ends the array; anything else is not a list of strings
                    self.state = "end" if ch == "]" else "gave_up"
                continue
            decoder = self.decoder
            assert decoder is not None
            pieces: list[str] = []
            while i < n and decoder.mode != "done":  # a character at a time: where the string ends matters
                pieces.append(decoder.feed(delta[i]))
                i += 1
            if "".join(pieces):
                out.append(("delta", self.index, "".join(pieces)))
            if decoder.mode == "done":
                self.state = "between"
                self.done.append(decoder.value)
                out.append(("done", self.index, decoder.value))
        return out


# ----------------------------------------------------------------------------- history -> upstream items


def _call_id(item: Mapping[str, Any], param: str, *, alias: str | None = None) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) and alias is not None:
        call_id = item.get(alias)
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"A {item.get('type')} item needs a string 'call_id'.", param=f"{param}.call_id",
                             code="invalid_value")
    return call_id


def _history_args(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    if item["type"] == "apply_patch_call":
        op = item.get("operation")
        if not isinstance(op, dict) or op.get("type") not in _OPERATIONS or not isinstance(op.get("path"), str):
            raise InvalidRequest("An apply_patch_call needs an 'operation' with a 'type' (create_file, update_file "
                                 "or delete_file) and a string 'path'.", param=f"{param}.operation",
                                 code="invalid_value")
        return {"operation": {k: op[k] for k in ("type", "path", "diff") if k in op}}
    action = item.get("action")
    if not isinstance(action, dict):
        raise InvalidRequest(f"A {item['type']} needs an 'action' object.", param=f"{param}.action",
                             code="invalid_value")
    return {"action": {k: v for k, v in action.items() if v is not None and k != "type"}}


def _output_text(item: Mapping[str, Any], param: str) -> str:
    itype, output = item["type"], item.get("output")
    if itype == "shell_call_output":
        if not isinstance(output, list):
            raise InvalidRequest("A shell_call_output needs an 'output' array.", param=f"{param}.output",
                                 code="invalid_type")
        # What the model reads: each command's stdout, stderr and outcome, as JSON.
        return orjson.dumps([{k: e.get(k) for k in ("stdout", "stderr", "outcome") if k in e}
                             for e in output if isinstance(e, dict)]).decode()
    if output is not None and not isinstance(output, str):
        raise InvalidRequest(f"A {itype}'s 'output' must be a string.", param=f"{param}.output",
                             code="invalid_type")
    if itype == "apply_patch_call_output":
        status = item.get("status")
        text = output or ""
        if status == "failed":
            return f"apply_patch failed: {text}" if text else "apply_patch failed"
        return text or "Done"
    return output or ""


def builtin_history(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A built-in call or output item in history as the function call or output vLLM understands."""
    itype = item["type"]
    if itype in BUILTIN_OUTPUT_TYPES:
        # openai-python names a local shell call's output by "id", the Agents SDK and the AI SDK by "call_id".
        call_id = _call_id(item, param, alias="id" if itype == "local_shell_call_output" else None)
        return {"type": "function_call_output", "call_id": call_id, "output": _output_text(item, param)}
    tool_type = builtin_tool_of(item) or ""
    return {"type": "function_call", "call_id": _call_id(item, param), "name": tool_type,
            "arguments": orjson.dumps(_history_args(item, param)).decode(), "status": "completed"}


def builtin_tool_of(item: Mapping[str, Any]) -> str | None:
    """The tool type of a client call item (``apply_patch_call`` -> ``apply_patch``), or None."""
    itype = item.get("type")
    return next((t for t, c in BUILTIN_CALL_TYPES.items() if c == itype), None)


def builtin_arguments(item: Mapping[str, Any]) -> str:
    """A client call item's payload as the function arguments it came from (for schema checks)."""
    if item.get("type") == "apply_patch_call":
        return orjson.dumps({"operation": item.get("operation")}).decode()
    action = item.get("action")
    action = {k: v for k, v in action.items() if v is not None and k != "type"} if isinstance(action, dict) else action
    return orjson.dumps({"action": action}).decode()


_V4A_UPDATE_LINE = re.compile(r"(@@.*|[ +\-].*|\*\*\* End of File|)")


def v4a_problem(operation: Mapping[str, Any]) -> str | None:
    """Why an ``apply_patch`` operation's diff is not V4A (None when it is, or when it has no diff).

    create_file: every line is an added line (``+``). update_file: hunk headers (``@@`` …), context (`` ``), removed
    (``-``) and added (``+``) lines and ``*** End of File``, with at least one change. Blank lines are taken as empty
    context, as the Agents SDK's own ``apply_diff`` reads them. Checked on the complete call: never holds a stream."""
    diff = operation.get("diff")
    otype = operation.get("type")
    if not isinstance(diff, str) or otype not in ("create_file", "update_file"):
        return None
    lines = diff.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for n, line in enumerate(lines, 1):
        ok = line.startswith("+") if otype == "create_file" else _V4A_UPDATE_LINE.fullmatch(line) is not None
        if not ok:
            return f"line {n} of the {otype} diff is not a V4A line"
    if otype == "update_file" and not any(line[:1] in ("+", "-") for line in lines):
        return "the update_file diff changes nothing"
    return None
