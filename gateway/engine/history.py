"""The history a request resolves to, read from the store before anything goes upstream: ``item_reference``
inputs, a ``previous_response_id`` chain (or a WebSocket connection's own recent responses), a ``conversation``'s
items — all bounded together by --max-history-bytes — and the request's input as stored items."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.engine.outcome import Turn
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.builtin_items import public_builtin_item
from gateway.protocol.conversations import conversation_ref
from gateway.runtime import new_id
from gateway.store import BrokenChainError, HistoryTooLargeError, ResponseStore, StoredResponse

__all__ = ["APPENDED_STATUSES", "HistoryBudget", "conversation_history", "from_newest_compaction", "history_from_chain",
           "public_input_items",
           "resolve_history", "resolve_references"]

# A response's turn joins its conversation when it ends with model output; a failed one adds nothing.
APPENDED_STATUSES = frozenset({"completed", "incomplete"})



class HistoryBudget:
    """What is left of --max-history-bytes for one request: item references first, then the chain or the
    conversation."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def exceeded(self, param: str) -> InvalidRequest:
        return InvalidRequest(f"The history this request resolves through '{param}' is larger than the gateway's "
                              f"limit of {self.limit} bytes (--max-history-bytes).", param=param,
                              code="history_too_large")


def public_input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (``input_items`` lists them)."""
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    elif isinstance(raw, list):
        items = raw
    else:
        items = []
    out = []
    for item in items:
        # A compaction_trigger is a request to compact, not content: no item to list or replay (no SDK item model
        # has it); the compaction item it produced stands in the output.
        if not isinstance(item, dict) or item.get("type") == "compaction_trigger":
            continue
        item = public_builtin_item(item)
        if "type" not in item and "role" in item:
            item["type"] = "message"
        if not item.get("id"):
            item["id"] = new_id("msg" if item.get("type") == "message" else "item")
        out.append(item)
    return out


def from_newest_compaction(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A loaded history from its newest ``compaction`` item on: that item stands for everything before it (its
    summary reaches the upstream in its place), so what it replaced is never sent again."""
    for i in range(len(items) - 1, -1, -1):
        if items[i].get("type") == "compaction":
            return items[i:] if i else items
    return items


def history_from_chain(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """Earlier inputs and outputs, in order, from the newest compaction item on; the new input is appended by
    the caller."""
    history: list[dict[str, Any]] = []
    for record in chain:
        history.extend(record.input_items)
        history.extend(i for i in record.response.get("output") or () if isinstance(i, dict))
    return from_newest_compaction(history)


async def conversation_history(store: ResponseStore | None, body: Mapping[str, Any], owner: str | None,
                               max_bytes: int | None = None) -> list[dict[str, Any]] | None:
    """The items of the conversation the request names, oldest first (public form, like the history of a
    ``previous_response_id`` chain); None when it names none. HistoryTooLargeError past ``max_bytes``."""
    conversation_id = conversation_ref(body)
    if conversation_id is None:
        return None
    if body.get("previous_response_id"):
        raise InvalidRequest("Mutually exclusive parameters: provide only one of 'previous_response_id' or "
                             "'conversation'.", param="conversation", code="mutually_exclusive_parameters")
    if store is None:
        raise InvalidRequest("conversation needs a response store, and this gateway runs with --store none.",
                             param="conversation", code="store_disabled")
    items = await store.get_conversation_items(conversation_id, owner=owner, max_bytes=max_bytes)
    if items is None:
        raise NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation")
    return from_newest_compaction(items)


async def resolve_references(store: ResponseStore | None, body: dict[str, Any], owner: str | None = None,
                         budget: HistoryBudget | None = None) -> dict[str, Any]:
    """``item_reference`` inputs replaced by the stored items they name (any input or output item), bounded by
    ``budget`` while they are loaded."""
    raw = body.get("input")
    if not isinstance(raw, list):
        return body
    refs = {i: item for i, item in enumerate(raw)
            if isinstance(item, dict) and item.get("type") == "item_reference"}
    if not refs:
        return body
    for i, item in refs.items():
        if not isinstance(item.get("id"), str) or not item["id"]:
            raise InvalidRequest("An item_reference needs the id of a stored item.", param=f"input[{i}].id",
                                 code="invalid_value")
    if store is None:
        raise InvalidRequest("item_reference needs a response store, and this gateway runs with --store none.",
                             param=f"input[{min(refs)}]", code="store_disabled")
    try:
        found = await store.get_items([item["id"] for item in refs.values()], owner=owner,
                                           max_bytes=None if budget is None else budget.left)
    except HistoryTooLargeError as exc:
        assert budget is not None
        at = next((i for i, item in refs.items() if item["id"] == exc.item_id), min(refs))
        raise budget.exceeded(f"input[{at}].id") from None
    if budget is not None:
        budget.left -= sum(len(orjson.dumps(item)) for item in found.values())
    for i, item in refs.items():
        if item["id"] not in found:
            raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"input[{i}].id",
                                 code="item_not_found")
    return {**body, "input": [found[item["id"]] if i in refs else item for i, item in enumerate(raw)]}

async def resolve_history(store: ResponseStore | None, body: dict[str, Any], owner: str | None = None,
                      turn: Turn | None = None, budget: HistoryBudget | None = None) -> list[dict[str, Any]]:
    max_bytes = None if budget is None else max(budget.left, 0)
    try:  # the `conversation` field's items
        conversation = await conversation_history(store, body, owner, max_bytes=max_bytes)
    except HistoryTooLargeError:
        assert budget is not None
        raise budget.exceeded("conversation") from None
    if conversation is not None:
        return conversation
    prev = body.get("previous_response_id")
    if not prev:
        return []
    local = turn.local_history(prev) if turn is not None else None
    if local is not None:
        return from_newest_compaction(local)
    if turn is not None and store is None:  # found nowhere: not on this connection, and no store
        raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
    if store is None:
        raise InvalidRequest("previous_response_id needs a response store, and this gateway runs with "
                             "--store none.", param="previous_response_id", code="store_disabled")
    try:
        chain = await store.get_chain(prev, owner=owner, max_bytes=max_bytes)
    except HistoryTooLargeError:
        assert budget is not None
        raise budget.exceeded("previous_response_id") from None
    except BrokenChainError as exc:
        raise NotFound(f"Response with id '{prev}' cannot be continued: an earlier response in its chain "
                       f"('{exc.missing_id}') no longer exists.", param="previous_response_id") from None
    if not chain:
        raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
    return history_from_chain(chain)
