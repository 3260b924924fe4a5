"""Compaction (issue 20): the upstream model summarizes a history, the gateway seals the summary into a
``compaction`` item's ``encrypted_content``, and opens it again when the item comes back in an input.

Three entry points share this module: ``POST /v1/responses/compact`` (``Compactor.compact_endpoint``),
``context_management: [{"type": "compaction", "compact_threshold": N}]`` and a final ``compaction_trigger`` input
item on ``POST /v1/responses`` (``ResponsesHandler`` via ``prepare``). The summary is sealed with the reasoning
sealer's keys (gateway.translate.sealing: AES-256-GCM under the store-kept or configured key every worker and
replica shares) for the ``compaction`` purpose and the caller's owner: clients can neither read nor forge it. An
item that does not open is a 400 naming ``input[N].encrypted_content`` (logged at warning level without content,
counted): dropping it would silently lose the whole history it replaced.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from gateway.config import Settings
from gateway.engine.context import ContextMeter
from gateway.engine.record import RequestRecord
from gateway.errors import GatewayError, InvalidRequest
from gateway.runtime import new_id
from gateway.translate.chat import build_chat_request
from gateway.translate.compaction_prompt import (
    COMPACTION_INSTRUCTIONS,
    compaction_input,
    is_compaction,
    summary_message,
)
from gateway.translate.restore import RequestState
from gateway.translate.rewrite import build_upstream_request
from gateway.translate.sealing import ReasoningSealer
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.usage import normalize_usage
from gateway.upstream.client import UpstreamClient

log = structlog.get_logger("gateway.compaction")

__all__ = ["PURPOSE", "Compactor", "Pending", "UpstreamRefused", "compact_threshold", "open_compactions"]

PURPOSE = "compaction"
_SUMMARY_BYTES = 256 * 1024  # the most of a summary the gateway seals (a runaway model is cut, not stored whole)


class UpstreamRefused(Exception):
    """The summarization turn was refused by the upstream: its error body and status go to the client as they
    are (a too-long history is the upstream's 400, in OpenAI's shape)."""

    def __init__(self, payload: Any, status: int) -> None:
        super().__init__(status)
        self.payload, self.status = payload, status


def compact_threshold(body: Mapping[str, Any]) -> int | None:
    """``context_management``'s compaction threshold (None: not asked for); a malformed value is a 400."""
    raw = body.get("context_management")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidRequest("'context_management' must be an array.", param="context_management",
                             code="invalid_type")
    threshold = None
    for i, entry in enumerate(raw):
        p = f"context_management[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "compaction":
            raise InvalidRequest("The only supported context_management entry type is 'compaction'.",
                                 param=f"{p}.type", code="invalid_value")
        value = entry.get("compact_threshold")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequest("'compact_threshold' must be a positive integer.", param=f"{p}.compact_threshold",
                                 code="invalid_value")
        threshold = value if threshold is None else min(threshold, value)
    return threshold


def open_compactions(items: Sequence[Any], sealer: ReasoningSealer, owner: str | None
                     ) -> tuple[list[Any], int | None]:
    """``items`` with each compaction item replaced by its summary as a message; the index of the first one that
    does not open for ``owner`` (tampered, another owner's, an unknown key), else None."""
    out: list[Any] = []
    for i, item in enumerate(items):
        if not is_compaction(item):
            out.append(item)
            continue
        opened = sealer.open(item.get("encrypted_content"), owner, purpose=PURPOSE)
        if opened is None:
            return out, i
        out.append(summary_message(opened["text"]))
    return out, None


def rejected(record: RequestRecord | None, param: str) -> InvalidRequest:
    """The 400 for a compaction item that does not open, warned (no content) and counted."""
    if record is not None:
        record.compaction_rejected += 1
    log.warning("compaction_blob_rejected", request_id=record.request_id if record else None, param=param,
                reason="encrypted_content did not open with the configured key(s) for this API key")
    return InvalidRequest("The compaction item's encrypted_content could not be verified: it was not issued by this "
                          "gateway for this API key, or it was modified.", param=param,
                          code="invalid_encrypted_content")


@dataclass(frozen=True, slots=True)
class Compaction:
    """A compaction made: its public item and what the summarization turn cost."""

    item: dict[str, Any]
    summary: str
    usage: dict[str, Any]


@dataclass
class Compactor:
    settings: Settings
    upstream: UpstreamClient
    sealer: Callable[[], ReasoningSealer]

    async def summarize(self, items: Sequence[Any], *, model: Any, instructions: str | None,
                        headers: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
        """The summarization turn on the configured upstream API: its text and usage. UpstreamRefused when the
        upstream answers with an error."""
        body: dict[str, Any] = {"model": model, "instructions": COMPACTION_INSTRUCTIONS,
                                "input": compaction_input(items, instructions), "store": False}
        if self.settings.compaction_max_output_tokens:
            body["max_output_tokens"] = self.settings.compaction_max_output_tokens
        chat = self.settings.upstream_api == "chat"
        ctx = resolve_tool_context({})
        if chat:
            path, up = "/v1/chat/completions", build_chat_request(body, ctx, (), with_tools=False)
        else:
            path, up = "/v1/responses", build_upstream_request(body, ctx)
        status, payload = await self.upstream.post_json(path, up, headers)
        if status >= 400:
            raise UpstreamRefused(payload, status)
        if not isinstance(payload, dict):
            raise UpstreamRefused({"error": {"message": "The upstream answered with an unexpected body.",
                                             "type": "server_error", "code": "upstream_error"}}, 502)
        text, usage = _chat_summary(payload) if chat else _responses_summary(payload)
        return text.strip()[:_SUMMARY_BYTES], usage

    def seal(self, summary: str, owner: str | None, item_id: str | None = None) -> dict[str, Any]:
        item_id = item_id or new_id("cmp")
        blob = self.sealer().seal({"id": item_id, "content": [{"text": summary}]}, owner, purpose=PURPOSE)
        return {"type": "compaction", "id": item_id, "encrypted_content": blob}

    async def compact(self, items: Sequence[Any], *, owner: str | None, model: Any, instructions: str | None,
                      headers: Mapping[str, str]) -> Compaction:
        summary, usage = await self.summarize(items, model=model, instructions=instructions, headers=headers)
        return Compaction(self.seal(summary, owner), summary, usage)

    def open_all(self, body: dict[str, Any], history: list[dict[str, Any]], owner: str | None,
                 record: RequestRecord | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The request's input and history with every compaction item opened into its summary; a 400 (warned,
        counted) for one that does not open."""
        raw = body.get("input")
        items = raw if isinstance(raw, list) else []
        if not any(map(is_compaction, [*history, *items])):
            return body, history
        sealer = self.sealer()
        opened, bad = open_compactions(items, sealer, owner)
        if bad is not None:
            raise rejected(record, f"input[{bad}].encrypted_content")
        if isinstance(raw, list):
            body = {**body, "input": opened}
        opened, bad = open_compactions(history, sealer, owner)
        if bad is not None:  # a stored item that no longer opens (its key was removed)
            raise rejected(record, "conversation" if body.get("conversation") else "previous_response_id")
        return body, opened

    async def prepare(self, body: dict[str, Any], history: list[dict[str, Any]], headers: Mapping[str, str],
                      record: RequestRecord, owner: str | None, meter: ContextMeter | None,
                      count_body: Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]
                      ) -> tuple[dict[str, Any], list[dict[str, Any]], Pending | None]:
        """A ``POST /v1/responses`` request's compaction work that sends nothing upstream: compaction items in the
        input and history opened into their summaries, ``context_management`` read (and kept from vLLM), and
        whether this response compacts — a final ``compaction_trigger``, or a threshold the input reaches
        (``count_body``: the upstream body the meter counts). ``run`` then makes the compaction."""
        raw = body.get("input")
        items: list[Any] = list(raw) if isinstance(raw, list) else []
        threshold = compact_threshold(body)
        trigger = False
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("type") == "compaction_trigger":
                if i != len(items) - 1:
                    raise InvalidRequest("A compaction_trigger must be the final input item.", param=f"input[{i}]",
                                         code="invalid_value")
                trigger = True
        if trigger:
            items = items[:-1]
        body = {k: v for k, v in body.items() if k != "context_management"}
        if not (trigger or threshold is not None or any(map(is_compaction, [*history, *items]))):
            return body, history, None
        if isinstance(raw, list):
            body = {**body, "input": items}
        body, history = self.open_all(body, history, owner, record)
        items = body["input"] if isinstance(raw, list) else []
        if not trigger:
            if threshold is None or meter is None:
                return body, history, None
            up = count_body(body, history)
            if not meter.could_reach(up, threshold):
                return body, history, None
            try:
                if await meter.count(up, headers) < threshold:
                    return body, history, None
            except GatewayError as exc:  # counting failed: no compaction this turn (the window check judges)
                log.warning("compaction_count_failed", request_id=record.request_id, status=exc.status,
                            error=exc.code)
                return body, history, None
        context = [*history, *([{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str)
                               else items)]
        return body, history, Pending(context, trigger, new_id("cmp"))

    async def run(self, pending: Pending, body: dict[str, Any], state: RequestState, headers: Mapping[str, str],
                  record: RequestRecord, owner: str | None) -> tuple[dict[str, Any], RequestState]:
        """The compaction ``prepare`` found due: the summarization turn, its sealed item first in the output
        (``state.lead``, its cost in ``lead_usage``) and, unless it was a trigger, the body the model answers
        from — the summary, then the current task from its last user message on. The history is spent: the
        compaction item replaces all of it (a later turn loads from that item on). UpstreamRefused when the
        upstream refuses the summarization turn."""
        instructions = body.get("instructions")
        summary, usage = await self.summarize(pending.context, model=body.get("model"),
                                              instructions=instructions if isinstance(instructions, str) else None,
                                              headers=headers)
        record.compactions += 1
        item = self.seal(summary, owner, pending.item_id)
        state = replace(state, lead=(item,), lead_usage=usage)
        if not pending.trigger:
            tail = pending.context[_last_user_message(pending.context):]
            body = {**body, "input": [summary_message(summary), *tail]}
        return body, state


@dataclass(frozen=True, slots=True)
class Pending:
    """A compaction a response is to make: the context it replaces, whether it is the whole response (a
    trigger), and the id its item will have (announced before it is made)."""

    context: list[Any]
    trigger: bool
    item_id: str

    def placeholder(self) -> dict[str, Any]:
        """The item as announced while the summary is written (its blob comes with its done event)."""
        return {"type": "compaction", "id": self.item_id, "encrypted_content": ""}


def _last_user_message(items: Sequence[Any]) -> int:
    for i in range(len(items) - 1, -1, -1):
        item = items[i]
        if isinstance(item, dict) and (item.get("type") or "message") == "message" and item.get("role") == "user":
            return i
    return len(items)


def _responses_summary(payload: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    texts = [str(part.get("text", "")) for item in payload.get("output") or () if isinstance(item, dict)
             and item.get("type") == "message" for part in item.get("content") or ()
             if isinstance(part, dict) and part.get("type") == "output_text"]
    return "".join(texts), normalize_usage(payload.get("usage")) or _zero()


def _chat_summary(payload: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    choices = payload.get("choices")
    message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else None
    text = message.get("content") if isinstance(message, dict) else None
    raw = payload.get("usage")
    usage: dict[str, Any] = raw if isinstance(raw, dict) else {}
    details = usage.get("prompt_tokens_details")
    return (text if isinstance(text, str) else ""), normalize_usage({
        "input_tokens": usage.get("prompt_tokens"), "output_tokens": usage.get("completion_tokens"),
        "total_tokens": usage.get("total_tokens"),
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else 0},
    }) or _zero()


def _zero() -> dict[str, Any]:
    """Usage of a turn the upstream reported none for, in the shape normalize_usage gives every usage."""
    usage = normalize_usage({"input_tokens": 0, "output_tokens": 0})
    assert usage is not None
    return usage


async def compact_endpoint(compactor: Compactor, body: Mapping[str, Any], owner: str | None, record: RequestRecord,
                           headers: Mapping[str, str],
                           history: Callable[[dict[str, Any]],
                                             Awaitable[tuple[list[dict[str, Any]], dict[str, Any]]]],
                           clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """``POST /v1/responses/compact``: the user's messages of the history (``previous_response_id``'s chain, then
    ``input``) followed by one compaction item, in OpenAI's ``response.compaction`` shape."""
    from gateway.translate.compaction_prompt import user_messages

    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_type")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    raw = body.get("input")
    if raw is not None and not isinstance(raw, str | list):
        raise InvalidRequest("'input' must be a string or an array of input items.", param="input",
                             code="invalid_type")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string.", param="instructions", code="invalid_type")
    if raw is None and not body.get("previous_response_id"):
        raise InvalidRequest("Provide 'input' or 'previous_response_id' to compact.", param="input",
                             code="missing_required_parameter")
    earlier, resolved = await history(dict(body))  # item references resolved in the input too
    raw = resolved.get("input")
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}] \
        if isinstance(raw, str) else [i for i in raw or () if not (isinstance(i, dict)
                                                                  and i.get("type") == "compaction_trigger")]
    sealer = compactor.sealer()
    opened, bad = open_compactions(items, sealer, owner)
    if bad is not None:
        raise rejected(record, f"input[{bad}].encrypted_content")
    opened_history, bad = open_compactions(earlier, sealer, owner)
    if bad is not None:
        raise rejected(record, "previous_response_id")
    made = await compactor.compact([*opened_history, *opened], owner=owner, model=body["model"],
                                   instructions=instructions, headers=headers)
    record.compactions += 1
    record.usage = made.usage
    kept = [_as_output_message(m) for m in user_messages([*earlier, *items])]
    return {"id": new_id("cmp"), "object": "response.compaction", "created_at": int(clock()),
            "output": [*kept, made.item], "usage": made.usage}


def _as_output_message(item: Mapping[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return {"type": "message", "id": item.get("id") or new_id("msg"), "role": "user", "status": "completed",
            "content": parts}
