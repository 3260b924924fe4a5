"""Responses <-> Chat Completions, for ``--upstream-api chat`` and the constrained steps. Pure; no I/O.

Two halves:

* ``build_chat_request`` turns the client's Responses request (after ``resolve_tool_context``) into a
  ``/v1/chat/completions`` body. History items go through ``upstream_input_items`` first, so custom and
  namespace calls are already in their upstream function form and the chat conversion sees only
  messages, function calls, function outputs and reasoning.
* ``ChatToResponsesEvents`` turns chat chunks into the *upstream-style* Responses events vLLM's own
  /v1/responses would send (``response.created`` ... ``response.completed``). Those are fed to the core
  ``FunctionSseTranslator``, so ids, custom tools, restoration and ``parallel_tool_calls`` work exactly
  as on the Responses path. ``completion_to_chunks`` replays a non-streamed completion as chunks, so
  both shapes share one converter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol.events import UpstreamEvent
from gateway.protocol.ids import Clock, IdFactory
from gateway.translate.rewrite import upstream_input_items, upstream_tools
from gateway.translate.tool_context import ResolvedToolContext
from gateway.translate.usage import add_usage

__all__ = [
    "ChatToResponsesEvents",
    "add_usage",
    "build_chat_request",
    "chat_messages",
    "chat_tool",
    "chat_tool_choice",
    "chat_usage",
    "completion_to_chunks",
]

# (event type, JSON data — or an event the gateway built, already parsed), what FunctionSseTranslator.feed takes

# Responses sampling fields that chat accepts under the same name (vLLM extras included).
_SAME_NAME = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "stop", "user", "logit_bias", "structured_outputs", "chat_template_kwargs",
              "service_tier", "n")


def chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) -> the chat form (nested under ``function``)."""
    fn: dict[str, Any] = {"name": tool["name"]}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is not None and not isinstance(content, list):
        raise InvalidRequest("Content must be a string or an array of parts.", param=param, code="invalid_type")
    parts = []
    for part in content or ():
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
    return "".join(parts)


def _chat_part(part: Any, param: str) -> dict[str, Any]:
    ptype = part.get("type") if isinstance(part, dict) else None
    if ptype in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if ptype == "refusal":
        return {"type": "text", "text": str(part.get("refusal", ""))}
    if ptype == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise InvalidRequest("An input_image part needs an 'image_url' (file_id is not supported by the "
                                 "upstream).", param=param, code="invalid_value")
        return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}}
    if ptype == "input_file":
        raise InvalidRequest("The upstream model server (vLLM) does not accept input_file parts; send the file's "
                             "text as an input_text part instead.", param=param, code="unsupported_content_part")
    raise InvalidRequest(f"Unsupported content part {ptype!r}.", param=param, code="invalid_value")


def _chat_content(content: Any, param: str) -> Any:
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest("Message content must be a string or an array of parts.", param=param,
                             code="invalid_type")
    parts = [_chat_part(p, f"{param}[{k}]") for k, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        # A plain string renders the same prompt on every chat template; arrays do not always.
        return "".join(p["text"] for p in parts)
    return parts


def _tool_output(output: Any, param: str) -> Any:
    if isinstance(output, str):
        return output
    # Text-part arrays are accepted as [{"type":"text"}] (docs/vllm-findings.md §a); images as image_url.
    return [_chat_part(p, f"{param}[{k}]") for k, p in enumerate(output)]


def _reasoning_text(item: Mapping[str, Any], param: str) -> str:
    text = _text_of(item.get("content"), f"{param}.content")
    summary = item.get("summary")
    if summary is not None and not isinstance(summary, list):
        raise InvalidRequest("A reasoning item's 'summary' must be an array of parts.", param=f"{param}.summary",
                             code="invalid_type")
    return text or "".join(str(s.get("text", "")) for s in summary or () if isinstance(s, dict))


def chat_messages(body: Mapping[str, Any], ctx: ResolvedToolContext,
                  history: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions, history, then the new input."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    raw = body.get("input")
    new: list[Any]
    if isinstance(raw, str):
        new = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list):
        new = list(raw)
    else:
        new = []
    items = upstream_input_items([*history, *new], ctx)
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        """The assistant message to extend: the last one if nothing came after it, else a new one."""
        if messages and messages[-1]["role"] == "assistant" and not reasoning:
            return messages[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
            reasoning.clear()
        messages.append(msg)
        return msg

    for i, item in enumerate(items):
        p = f"input[{i}]"
        itype = item.get("type", "message" if "role" in item else None)
        if itype == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"Unsupported message role {role!r}.", param=f"{p}.role", code="invalid_value")
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after a call is a new turn
                    msg = {"role": "assistant", "content": ""}
                    messages.append(msg)
                msg["content"] = (msg.get("content") or "") + _text_of(item.get("content"), f"{p}.content")
            else:
                messages.append({"role": role, "content": _chat_content(item.get("content"), f"{p}.content")})
        elif itype == "function_call":
            msg = assistant()
            args = item.get("arguments")
            msg.setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": args if isinstance(args, str) else "{}"},
            })
        elif itype == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _tool_output(item["output"], f"{p}.output")})
        elif itype == "reasoning":
            text = _reasoning_text(item, p)
            if text:
                reasoning.append(text)
        elif itype == "item_reference":
            raise InvalidRequest("item_reference inputs are not supported with --upstream-api chat.", param=p,
                                 code="unsupported_input_item")
        # Hosted-tool items (web_search_call, ...) have no chat form and are left out.
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls") and msg.get("content") == "":
            msg["content"] = None
    return messages


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


def chat_tool_choice(ctx: ResolvedToolContext) -> Any:
    choice = ctx.upstream_tool_choice
    if isinstance(choice, dict):
        if choice.get("type") == "function" and choice.get("name"):
            return {"type": "function", "function": {"name": choice["name"]}}
        return "auto"  # hosted or newer choices have no chat form
    return choice


def build_chat_request(body: Mapping[str, Any], ctx: ResolvedToolContext, history: Sequence[Any] = (), *,
                       with_tools: bool = True) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body for a Responses request."""
    up: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body, ctx, history)}
    for key in _SAME_NAME:
        if body.get(key) is not None:
            up[key] = body[key]
    if isinstance(body.get("max_output_tokens"), int):
        up["max_tokens"] = body["max_output_tokens"]
    if isinstance(body.get("top_logprobs"), int) and body["top_logprobs"] > 0:
        up["logprobs"] = True
        up["top_logprobs"] = body["top_logprobs"]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        up["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        up["reasoning_effort"] = reasoning["effort"]
    if with_tools and ctx.upstream_tool_choice != "none":
        # Hosted tools have no chat form; only the callable ones are offered.
        tools = [chat_tool(t) for t in upstream_tools(ctx) if t.get("type") == "function"]
        if tools:
            up["tools"] = tools
            if ctx.tool_choice_given:  # chat's own default with tools is auto, as the request's is
                up["tool_choice"] = chat_tool_choice(ctx)
            if ctx.parallel_tool_calls_given:
                up["parallel_tool_calls"] = ctx.parallel_tool_calls
    if body.get("stream"):
        up["stream"] = True
        up["stream_options"] = {"include_usage": True}
    return up


# ---------------------------------------------------------------------------------------------- chunks -> events


def chat_usage(u: Any) -> dict[str, Any] | None:
    """A chat completion's usage in the Responses shape (numbers only in the details)."""
    if not isinstance(u, dict):
        return None
    details = raw if isinstance(raw := u.get("completion_tokens_details"), dict) else {}
    cached = raw if isinstance(raw := u.get("prompt_tokens_details"), dict) else {}
    inp, out = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": int(cached.get("cached_tokens") or 0),
                                 "cache_write_tokens": int(cached.get("cache_write_tokens") or 0)},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": int(details.get("reasoning_tokens") or 0)},
        "total_tokens": int(u.get("total_tokens") or inp + out),
    }


@dataclass(slots=True)
class _Open:
    kind: str  # message | reasoning | call
    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    chat_index: int = -1
    pending_args: list[str] = field(default_factory=list)  # arguments seen before the call's name
    announced: bool = False


class ChatToResponsesEvents:
    """Chat completion chunks in, upstream-style Responses events out.

    Items are strictly sequential, as vLLM's /v1/responses sends them: a change from reasoning to
    text to a call (or from one call index to the next) closes the open item first. ``feed`` takes one
    parsed chunk; ``done`` is called at ``[DONE]`` or at the end of the body and emits the terminal
    event, or nothing when no ``finish_reason`` ever came (the translator then fails the stream).
    """

    def __init__(self, model: str | None = None, response_id: str | None = None,
                 max_unnamed_bytes: int = 256 * 1024, *, ids: IdFactory, clock: Clock) -> None:
        self._ids = ids  # fresh ids for the items this converter opens
        self.response: dict[str, Any] = {
            "id": response_id or ids("resp"), "object": "response", "created_at": int(clock()),
            "model": model, "status": "in_progress", "output": [], "usage": None, "error": None,
            "incomplete_details": None,
        }
        self.output: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.base_usage: dict[str, Any] | None = None  # earlier steps' usage (a constrained answer's pick step)
        self.finished = False
        self._seq = 0
        self._started = False
        self._open: _Open | None = None
        self._max_unnamed = max_unnamed_bytes

    # -- emission

    def _ev(self, etype: str, payload: dict[str, Any]) -> UpstreamEvent:
        payload["type"] = etype
        payload["sequence_number"] = self._seq
        self._seq += 1
        return UpstreamEvent(etype, "", payload)  # built: the translator takes it as it is

    def _start(self, chunk: Mapping[str, Any]) -> list[UpstreamEvent]:
        if self._started:
            return []
        self._started = True
        if isinstance(chunk.get("model"), str) and not self.response.get("model"):
            self.response["model"] = chunk["model"]
        if isinstance(chunk.get("created"), int):
            self.response["created_at"] = chunk["created"]
        snap = dict(self.response)
        return [self._ev("response.created", {"response": snap}),
                self._ev("response.in_progress", {"response": dict(snap)})]

    def _open_item(self, kind: str, item: dict[str, Any]) -> list[UpstreamEvent]:
        out = self._close()
        self._open = _Open(kind, len(self.output), item)
        self.output.append(item)
        opened = dict(item)
        if kind == "call":
            opened["arguments"] = ""
        out.append(self._ev("response.output_item.added", {"item": opened, "output_index": self._open.index}))
        if kind == "message":
            out.append(self._ev("response.content_part.added", {
                "content_index": 0, "item_id": item["id"], "output_index": self._open.index,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}}))
        elif kind == "reasoning":
            out.append(self._ev("response.content_part.added", {
                "content_index": 0, "item_id": item["id"], "output_index": self._open.index,
                "part": {"text": "", "type": "reasoning_text"}}))
        return out

    def _close(self) -> list[UpstreamEvent]:
        op, self._open = self._open, None
        if op is None:
            return []
        base = {"item_id": op.item["id"], "output_index": op.index}
        text = "".join(op.text)
        out: list[UpstreamEvent] = []
        if op.kind == "message":
            part = {"annotations": [], "text": text, "type": "output_text", "logprobs": []}
            out.append(self._ev("response.output_text.done", {**base, "content_index": 0, "text": text,
                                                               "logprobs": []}))
            out.append(self._ev("response.content_part.done", {**base, "content_index": 0, "part": part}))
            op.item.update(content=[part], status="completed")
        elif op.kind == "reasoning":
            part = {"text": text, "type": "reasoning_text"}
            out.append(self._ev("response.reasoning_text.done", {**base, "content_index": 0, "text": text}))
            out.append(self._ev("response.content_part.done", {**base, "content_index": 0, "part": part}))
            op.item.update(content=[part], status="completed")
        else:
            if not op.item.get("name"):
                # Name never came: let the translator decide (it fails the response clearly).
                op.item["arguments"] = "".join(op.pending_args)
            else:
                op.item.update(arguments=text, status="completed")
                out.append(self._ev("response.function_call_arguments.done",
                                    {**base, "arguments": text, "name": op.item["name"]}))
        out.append(self._ev("response.output_item.done", {"item": dict(op.item), "output_index": op.index}))
        return out

    # -- input

    def feed(self, chunk: Mapping[str, Any]) -> list[UpstreamEvent]:
        if self.finished:
            return []
        err = chunk.get("error")
        if isinstance(err, dict):
            self.finished = True
            return [UpstreamEvent.built({"type": "error", "code": err.get("code") if isinstance(
                err.get("code"), str) else "upstream_error", "message": str(err.get("message") or
                "The upstream reported an error."), "sequence_number": self._seq})]
        out = self._start(chunk)
        usage = chat_usage(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1 has no Responses form; the first choice is the answer
            delta = raw if isinstance(raw := choice.get("delta"), dict) else {}
            out += self._delta(delta)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return out

    def _delta(self, delta: Mapping[str, Any]) -> list[UpstreamEvent]:
        out: list[UpstreamEvent] = []
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            if self._open is None or self._open.kind != "reasoning":
                out += self._open_item("reasoning", {"id": self._ids("rs"), "type": "reasoning", "summary": [],
                                                     "content": [], "status": "in_progress"})
            assert self._open is not None
            self._open.text.append(reasoning)
            out.append(self._ev("response.reasoning_text.delta", {
                "content_index": 0, "delta": reasoning, "item_id": self._open.item["id"],
                "output_index": self._open.index}))
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self._open is None or self._open.kind != "message":
                out += self._open_item("message", {"id": self._ids("msg"), "type": "message", "role": "assistant",
                                                   "content": [], "status": "in_progress"})
            assert self._open is not None
            self._open.text.append(content)
            out.append(self._ev("response.output_text.delta", {
                "content_index": 0, "delta": content, "item_id": self._open.item["id"], "logprobs": [],
                "output_index": self._open.index}))
        for tc in delta.get("tool_calls") or ():
            if isinstance(tc, dict):
                out += self._tool_call(tc)
        return out

    def _tool_call(self, tc: Mapping[str, Any]) -> list[UpstreamEvent]:
        out: list[UpstreamEvent] = []
        idx = tc.get("index", 0)
        fn = raw if isinstance(raw := tc.get("function"), dict) else {}
        op = self._open
        if op is None or op.kind != "call" or op.chat_index != idx:
            out += self._open_call(tc, idx)
            op = self._open
            assert op is not None
        if fn.get("name") and not op.item.get("name"):
            op.item["name"] = fn["name"]
        args = fn.get("arguments")
        if not op.item.get("name"):
            if isinstance(args, str):
                op.pending_args.append(args)
                if sum(map(len, op.pending_args)) > self._max_unnamed:
                    self.finished = True
                    return [*out, UpstreamEvent.built({
                        "type": "error", "code": "unnamed_call_buffer_overflow",
                        "message": "A tool call's name did not arrive within the buffer limit."})]
            return out
        if op.pending_args or not op.announced:
            out += self._announce(op)
        if isinstance(args, str) and args:
            out += self._args_delta(op, args)
        return out

    def _open_call(self, tc: Mapping[str, Any], idx: Any) -> list[UpstreamEvent]:
        out = self._close()
        call_id = tc.get("id") if isinstance(tc.get("id"), str) else self._ids("call")
        item = {"arguments": "", "call_id": call_id, "name": None, "type": "function_call", "id": self._ids("fc"),
                "status": "in_progress"}
        self._open = _Open("call", len(self.output), item, chat_index=idx)
        self.output.append(item)
        return out

    def _announce(self, op: _Open) -> list[UpstreamEvent]:
        """``output_item.added`` once the name is known (vLLM's rule: names come first)."""
        out: list[UpstreamEvent] = []
        if not op.announced:
            op.announced = True
            opened = dict(op.item)
            opened["arguments"] = ""
            out.append(self._ev("response.output_item.added", {"item": opened, "output_index": op.index}))
        pending, op.pending_args = "".join(op.pending_args), []
        if pending:
            out += self._args_delta(op, pending)
        return out

    def _args_delta(self, op: _Open, args: str) -> list[UpstreamEvent]:
        op.text.append(args)
        return [self._ev("response.function_call_arguments.delta", {
            "delta": args, "item_id": op.item["id"], "output_index": op.index})]

    def done(self) -> list[UpstreamEvent]:
        """End of the chunk stream. Emits the terminal event if the answer finished."""
        if self.finished or self.finish_reason is None:
            return []
        self.finished = True
        out = self._close()
        reason = self.finish_reason
        status = "incomplete" if reason in ("length", "content_filter") else "completed"
        resp = dict(self.response)
        resp.update(status=status, output=[dict(i) for i in self.output], usage=add_usage(self.base_usage, self.usage))
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens" if reason == "length" else "content_filter"}
        out.append(self._ev("response.completed", {"response": resp}))
        return out


def completion_to_chunks(payload: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """A non-streamed chat completion as the chunks a stream would have carried."""
    base = {k: payload.get(k) for k in ("id", "model", "created")}
    choices = payload.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    msg = raw if isinstance(raw := choice.get("message"), dict) else {}
    delta: dict[str, Any] = {}
    reasoning = msg.get("reasoning") if msg.get("reasoning") is not None else msg.get("reasoning_content")
    if isinstance(reasoning, str):
        delta["reasoning"] = reasoning
    if isinstance(msg.get("content"), str):
        delta["content"] = msg["content"]
    calls = []
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        if isinstance(tc, dict):
            calls.append({"index": i, "id": tc.get("id"), "type": "function", "function": tc.get("function") or {}})
    if calls:
        delta["tool_calls"] = calls
    yield {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason") or "stop"}]}
    if payload.get("usage"):
        yield {**base, "choices": [], "usage": payload["usage"]}
