"""The constrained steps as chat requests, and their answers as tool-call chunks. Pure; no I/O.

A pinned call is generated in up to two steps on ``/v1/chat/completions``:

* *pick* (several allowed tools): ``structured_outputs: {"choice": [names]}``, the prompt listing each
  tool's name and description; the answer is one upstream tool name;
* *arguments*: the content of the call under the tool's own constraint: ``{"json": parameters}`` for a
  function, ``{"grammar": lark}`` / ``{"regex": ...}`` for a grammar custom tool, free text for a text
  custom tool.

``ContentAsCall`` rewrites the arguments step's chunks (``delta.content``) into ``delta.tool_calls``
chunks of one call, so ``ChatToResponsesEvents`` and the core translator present it exactly like a call
the model made itself: for a custom tool the content is wrapped as the JSON ``{"input": "..."}`` the
translator decodes into ``custom_tool_call_input`` deltas.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.protocol.events import UpstreamEvent
from gateway.runtime import new_id
from gateway.translate.builtin_tools import BUILTIN_TOOL_TYPES
from gateway.translate.chat import add_usage, chat_usage
from gateway.translate.tool_context import ToolInfo

__all__ = ["ContentAsCall", "InputContinuation", "args_request", "constraint_for", "pick_request"]

PICK_MAX_TOKENS = 32
# Tools whose calls are JSON arguments under a schema (the built-in client tools are offered as functions).
_JSON_KINDS = ("function", "mcp", *BUILTIN_TOOL_TYPES)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def constraint_for(info: ToolInfo) -> dict[str, Any] | None:
    """The ``structured_outputs`` value that makes any answer a valid call content; None for free text."""
    if info.kind in _JSON_KINDS:
        params = info.definition.get("parameters")
        return {"json": params if isinstance(params, dict) and params else _ANY_OBJECT}
    grammar = info.grammar
    if grammar is None:
        return None
    syntax, definition = grammar
    return {"regex": definition} if syntax == "regex" else {"grammar": definition}


def _describe(info: ToolInfo) -> str:
    desc = str(info.definition.get("description") or "").strip()
    return f"{info.upstream_name}: {desc}" if desc else info.upstream_name


def _with_instruction(messages: Sequence[Mapping[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """The conversation plus the step's instruction as the last user turn.

    Appended to a trailing user message when there is one, so templates that insist on alternating
    roles still render; otherwise a new user message.
    """
    out = [dict(m) for m in copy.deepcopy(list(messages))]
    if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
        out[-1]["content"] = f"{out[-1]['content']}\n\n{instruction}"
    else:
        out.append({"role": "user", "content": instruction})
    return out


def _base(chat_body: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "user", "chat_template_kwargs")
    return {k: chat_body[k] for k in keep if k in chat_body}


def pick_request(chat_body: Mapping[str, Any], tools: Sequence[ToolInfo]) -> dict[str, Any]:
    listing = "\n".join(f"- {_describe(t)}" for t in tools)
    instruction = ("You must call exactly one of these tools next. Answer with the name of the tool to call, "
                   f"and nothing else.\nTools:\n{listing}")
    body = _base(chat_body)
    body.update(messages=_with_instruction(chat_body["messages"], instruction),
                structured_outputs={"choice": [t.upstream_name for t in tools]}, max_tokens=PICK_MAX_TOKENS)
    return body


def args_request(chat_body: Mapping[str, Any], info: ToolInfo, *, stream: bool,
                 max_tokens: int | None = None) -> dict[str, Any]:
    constraint = constraint_for(info)
    desc = str(info.definition.get("description") or "").strip()
    head = f"You are calling the tool `{info.upstream_name}` now." + (f" Its description: {desc}" if desc else "")
    if info.kind in _JSON_KINDS:
        schema = orjson.dumps(constraint["json"] if constraint else _ANY_OBJECT).decode()
        what = f"Write only the call's arguments: one JSON object matching this JSON Schema:\n{schema}"
    elif info.grammar is not None:
        syntax, definition = info.grammar
        kind = "regular expression" if syntax == "regex" else "Lark grammar"
        what = f"Write only the tool's raw input (not JSON); it must match this {kind}:\n{definition}"
    else:
        what = "Write only the tool's raw free-form input (not JSON)."
    body = _base(chat_body)
    body["messages"] = _with_instruction(chat_body["messages"], f"{head}\n{what}")
    if constraint is not None:
        body["structured_outputs"] = constraint
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class ContentAsCall:
    """Chunks of the arguments step -> chunks of one tool call (``tool_calls[0]``) with the same text."""

    def __init__(self, info: ToolInfo, call_id: str | None = None) -> None:
        self.info = info
        self.call_id = call_id or new_id("call")
        self.custom = info.kind == "custom"
        self.content: list[str] = []
        self._opened = False
        self._closed = False

    def _open(self) -> list[dict[str, Any]]:
        if self._opened:
            return []
        self._opened = True
        calls: list[dict[str, Any]] = [{"index": 0, "id": self.call_id, "type": "function",
                                        "function": {"name": self.info.upstream_name}}]
        if self.custom:
            calls.append({"index": 0, "function": {"arguments": '{"input": "'}})
        return calls

    def feed(self, chunk: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in chunk.items() if k != "choices"}
        choices = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = dict(choice.get("delta") or {})
            content = delta.pop("content", None)
            delta.pop("tool_calls", None)
            calls: list[dict[str, Any]] = []
            if isinstance(content, str) and content:
                calls += self._open()
                self.content.append(content)
                piece = orjson.dumps(content).decode()[1:-1] if self.custom else content
                calls.append({"index": 0, "function": {"arguments": piece}})
            finish = choice.get("finish_reason")
            if finish:
                calls += self._open()
                if self.custom and not self._closed:
                    self._closed = True
                    calls.append({"index": 0, "function": {"arguments": '"}'}})
                # A named call ends as vLLM's named tool_choice does; a cut-off stays "length".
                finish = "length" if finish == "length" else "stop"
            if calls:
                delta["tool_calls"] = calls
            choices.append({**choice, "delta": delta, "finish_reason": finish})
        out["choices"] = choices
        return out

    @property
    def text(self) -> str:
        return "".join(self.content)


class InputContinuation:
    """A constrained step's chat chunks -> the rest of one *already announced* upstream call. Pure.

    Used when the upstream opened a grammar custom call under ``tool_choice: auto`` and the gateway took
    over its input (``gateway.engine.takeover``): the client has seen the call's ``output_item.added`` under
    the upstream's item id and output index; the step's ``delta.content`` pieces continue that same item as
    ``custom_tool_call_input.delta`` events carrying the text as the model wrote it (the event a Responses
    upstream that runs custom tools itself would send: never JSON-escaped here only for the translator to
    decode it again), the step's finish closes it (``function_call_arguments.done`` with the whole
    ``{"input": "…"}``, then ``output_item.done``), and the end of the step's stream is the response's terminal
    event (the original upstream stream was closed, so nothing follows the call). ``base`` is the upstream's
    last response snapshot; ``base_usage`` the usage of earlier steps.
    """

    def __init__(self, added: Mapping[str, Any], base: Mapping[str, Any] | None,
                 base_usage: dict[str, Any] | None = None) -> None:
        item = dict(added.get("item") or {})
        self.output_index: int = int(added.get("output_index") or 0)
        self.item = item
        self._item_id = item.get("id")
        self.base = dict(base or {})
        self.base_usage = base_usage
        self.usage: dict[str, Any] | None = None
        self.content: list[str] = []
        self.finish_reason: str | None = None
        self.finished = False
        self._closed = False

    @property
    def text(self) -> str:
        return "".join(self.content)

    def _ev(self, etype: str, payload: dict[str, Any]) -> UpstreamEvent:
        """An event as the translator takes it, already parsed (never serialized only to be parsed again)."""
        payload["type"] = etype
        payload["sequence_number"] = -1  # the translator numbers what it emits
        return UpstreamEvent(etype, "", payload)

    def _delta(self, piece: str) -> UpstreamEvent:
        etype = "response.custom_tool_call_input.delta"  # one literal: every content chunk makes one
        return UpstreamEvent(etype, "", {"type": etype, "sequence_number": -1, "delta": piece,
                                         "item_id": self._item_id, "output_index": self.output_index})

    def feed(self, chunk: Mapping[str, Any]) -> list[UpstreamEvent]:
        if self.finished:
            return []
        err = chunk.get("error")
        if isinstance(err, dict):
            self.finished = True
            code = err.get("code") if isinstance(err.get("code"), str) else "upstream_error"
            return [self._ev("error", {"code": code, "message": str(err.get("message") or
                                                                   "The upstream reported an error.")})]
        usage = chat_usage(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        out: list[UpstreamEvent] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = raw if isinstance(raw := choice.get("delta"), dict) else {}
            content = delta.get("content")
            if isinstance(content, str) and content and not self._closed:
                self.content.append(content)
                out.append(self._delta(content))
            if choice.get("finish_reason") and not self._closed:
                self.finish_reason = str(choice["finish_reason"])
                out += self._close()
        return out

    def _close(self) -> list[UpstreamEvent]:
        self._closed = True
        args = '{"input": ' + orjson.dumps(self.text).decode() + "}"
        self.item.update(arguments=args, status="completed")
        out = [self._ev("response.function_call_arguments.done", {
            "arguments": args, "item_id": self.item.get("id"), "name": self.item.get("name"),
            "output_index": self.output_index})]
        out.append(self._ev("response.output_item.done", {"item": dict(self.item), "output_index": self.output_index}))
        return out

    def done(self) -> list[UpstreamEvent]:
        """The step's stream ended: the response's terminal event (nothing if it never finished the call:
        the translator then fails the response rather than leave the client hanging)."""
        if self.finished or not self._closed:
            return []
        self.finished = True
        cut = self.finish_reason == "length"
        resp = dict(self.base)
        resp.update(status="incomplete" if cut else "completed", output=[],
                    usage=add_usage(self.base_usage, self.usage), error=None,
                    incomplete_details={"reason": "max_output_tokens"} if cut else None)
        return [self._ev("response.incomplete" if cut else "response.completed", {"response": resp})]
