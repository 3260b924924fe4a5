"""The Conversations API (``/v1/conversations``) and the hook ``POST /v1/responses`` uses for
``conversation``: the conversation's items as history (the turn's items are appended by the response's own
store write, gateway.engine.respond, in the record's transaction).

Every endpoint is scoped to the caller's owner (gateway.server.auth.request_owner): another owner's
conversation or item answers 404 exactly as an unknown id does.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.engine.record import RequestRecord
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.conversations import check_metadata, conversation_item, request_items
from gateway.protocol.items import listed_item
from gateway.runtime import new_id
from gateway.server.auth import request_owner
from gateway.server.http import OrjsonResponse, list_query, read_body
from gateway.store import CursorNotFoundError, HistoryTooLargeError, ResponseStore, StoredConversation

log = structlog.get_logger("gateway.conversations")

__all__ = ["ConversationsApi"]

Handler = Callable[[Request, RequestRecord], Awaitable[Response]]
Wrap = Callable[[str, Handler], Callable[[Request], Awaitable[Response]]]

def _conversation_not_found(conversation_id: str, param: str = "conversation_id") -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", param=param)


# ---------------------------------------------------------------------------- the endpoints

async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await read_body(request, limit)
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def _list(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    items = [listed_item(i) for i in items]  # in the SDK's item shapes, whenever they were stored
    return {
        "object": "list",
        "data": items,
        "first_id": items[0].get("id") if items else None,
        "last_id": items[-1].get("id") if items else None,
        "has_more": has_more,
    }


@dataclass
class ConversationsApi:
    """The handlers; ``store`` returns the store or raises (``--store none``)."""

    store: Callable[[], ResponseStore]
    max_body_bytes: int
    # --max-history-bytes: what the items an item_reference names may add up to (loaded only if they fit).
    max_history_bytes: int = 32 * 1024 * 1024
    clock: Callable[[], float] = field(default=time.time)

    def routes(self, wrap: Wrap) -> list[Route]:
        one, items, item = "/v1/conversations/{id}", "/v1/conversations/{id}/items", \
            "/v1/conversations/{id}/items/{item_id}"
        return [
            Route("/v1/conversations", wrap("/v1/conversations", self.create), methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", wrap(one, self.retrieve), methods=["GET"]),
            Route("/v1/conversations/{conversation_id}", wrap(one, self.update), methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", wrap(one, self.delete), methods=["DELETE"]),
            Route("/v1/conversations/{conversation_id}/items", wrap(items, self.list_items), methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items", wrap(items, self.create_items), methods=["POST"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", wrap(item, self.retrieve_item),
                  methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", wrap(item, self.delete_item),
                  methods=["DELETE"]),
        ]

    async def _items(self, store: ResponseStore, raw: list[dict[str, Any]], owner: str | None
                     ) -> list[dict[str, Any]]:
        """Public items with ids; ``item_reference``s replaced by the (owner's) stored items they name."""
        refs = [item["id"] for item in raw if item.get("type") == "item_reference"]
        try:
            found = await store.get_items(refs, owner=owner, max_bytes=self.max_history_bytes) if refs else {}
        except HistoryTooLargeError as exc:
            at = next((i for i, item in enumerate(raw) if item.get("type") == "item_reference"
                       and item["id"] == exc.item_id), 0)
            raise InvalidRequest(f"The items referenced by 'items' are larger than the gateway's limit of "
                                 f"{self.max_history_bytes} bytes (--max-history-bytes).", param=f"items[{at}].id",
                                 code="history_too_large") from None
        out = []
        for i, item in enumerate(raw):
            if item.get("type") == "item_reference":
                if item["id"] not in found:
                    raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"items[{i}].id",
                                         code="item_not_found")
                item = found[item["id"]]
            out.append(conversation_item(item, new_id))
        return out

    async def create(self, request: Request, record: RequestRecord) -> Response:
        body = await _json_body(request, self.max_body_bytes)
        metadata = check_metadata(body.get("metadata"))
        raw = request_items(body.get("items"))
        store, owner = self.store(), request_owner(request.scope)
        items = await self._items(store, raw, owner)
        now = int(self.clock())
        conversation = StoredConversation(id=new_id("conv"), created_at=now, updated_at=now, metadata=metadata,
                                          owner=owner)
        await store.create_conversation(conversation, items)
        return OrjsonResponse(conversation.public())

    async def retrieve(self, request: Request, record: RequestRecord) -> Response:
        cid = request.path_params["conversation_id"]
        conversation = await self.store().get_conversation(cid, owner=request_owner(request.scope))
        if conversation is None:
            raise _conversation_not_found(cid)
        return OrjsonResponse(conversation.public())

    async def update(self, request: Request, record: RequestRecord) -> Response:
        cid = request.path_params["conversation_id"]
        body = await _json_body(request, self.max_body_bytes)
        if "metadata" not in body:
            raise InvalidRequest("Missing required parameter: 'metadata'.", param="metadata",
                                 code="missing_required_parameter")
        metadata = check_metadata(body["metadata"])
        conversation = await self.store().update_conversation(cid, metadata, int(self.clock()),
                                                              owner=request_owner(request.scope))
        if conversation is None:
            raise _conversation_not_found(cid)
        return OrjsonResponse(conversation.public())

    async def delete(self, request: Request, record: RequestRecord) -> Response:
        cid = request.path_params["conversation_id"]
        if not await self.store().delete_conversation(cid, owner=request_owner(request.scope)):
            raise _conversation_not_found(cid)
        return OrjsonResponse({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request, record: RequestRecord) -> Response:
        cid = request.path_params["conversation_id"]
        query = request.query_params
        limit, order = list_query(query)
        after = query.get("after") or None
        try:
            page = await self.store().list_conversation_items(cid, limit=limit, order=order, after=after,
                                                              owner=request_owner(request.scope))
        except CursorNotFoundError:
            raise InvalidRequest(f"No item with id '{after}' in this conversation.", param="after",
                                 code="invalid_value") from None
        if page is None:
            raise _conversation_not_found(cid)
        return OrjsonResponse(_list(*page))

    async def create_items(self, request: Request, record: RequestRecord) -> Response:
        cid = request.path_params["conversation_id"]
        body = await _json_body(request, self.max_body_bytes)
        if "items" not in body:
            raise InvalidRequest("Missing required parameter: 'items'.", param="items",
                                 code="missing_required_parameter")
        raw = request_items(body["items"])
        store, owner = self.store(), request_owner(request.scope)
        if await store.get_conversation(cid, owner=owner) is None:  # before resolving any item_reference
            raise _conversation_not_found(cid)
        items = await self._items(store, raw, owner)
        if not await store.append_conversation_items(cid, items, int(self.clock()), owner=owner):
            raise _conversation_not_found(cid)
        return OrjsonResponse(_list(items, False))

    async def retrieve_item(self, request: Request, record: RequestRecord) -> Response:
        cid, iid = request.path_params["conversation_id"], request.path_params["item_id"]
        store, owner = self.store(), request_owner(request.scope)
        item = await store.get_conversation_item(cid, iid, owner=owner)
        if item is None:
            if await store.get_conversation(cid, owner=owner) is None:
                raise _conversation_not_found(cid)
            raise NotFound(f"Item with id '{iid}' not found.", param="item_id")
        return OrjsonResponse(listed_item(item))

    async def delete_item(self, request: Request, record: RequestRecord) -> Response:
        cid, iid = request.path_params["conversation_id"], request.path_params["item_id"]
        store, owner = self.store(), request_owner(request.scope)
        deleted = await store.delete_conversation_item(cid, iid, int(self.clock()), owner=owner)
        conversation = await store.get_conversation(cid, owner=owner)
        if conversation is None:
            raise _conversation_not_found(cid)
        if not deleted:
            raise NotFound(f"Item with id '{iid}' not found.", param="item_id")
        return OrjsonResponse(conversation.public())  # OpenAI answers with the conversation
