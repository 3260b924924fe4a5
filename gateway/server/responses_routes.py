"""The ``/v1/responses`` routes over HTTP: create (the engine, gateway.server.responses_http), compact,
retrieve (and resume a background response's stream), delete, cancel, the input items, and the input token
count."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.engine.record import RequestRecord
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.items import listed_item
from gateway.protocol.request import parse_request_body
from gateway.server.admission import Handler
from gateway.server.auth import request_owner
from gateway.server.http import OrjsonResponse, SseResponse, cancel_on_disconnect, list_query, read_body
from gateway.server.responses_http import create_response as create_http_response
from gateway.server.services import Services

__all__ = ["paginate", "response_routes"]

Wrap = Callable[[str, Handler], Callable[[Request], Any]]


def response_routes(services: Callable[[], Services], wrap: Wrap) -> list[Route]:
    async def create_response(request: Request, record: RequestRecord) -> Response:
        handler = services().responses
        # A non-streamed answer is cancelled (its upstream request closed) if the client leaves while it waits;
        # a streamed one watches the connection itself (SseResponse).
        return await cancel_on_disconnect(request, lambda req: create_http_response(handler, req, record),
                                          when=lambda: not record.stream, on_disconnect=lambda: _left(record))

    async def compact_response(request: Request, record: RequestRecord) -> Response:
        handler = services().responses
        raw = await read_body(request, handler.settings.max_body_bytes)
        record.request_bytes = len(raw)
        outcome = await handler.compact(parse_request_body(raw), dict(request.headers),
                                        request_owner(request.scope), record)
        return OrjsonResponse(outcome.payload, status_code=outcome.status, headers={"x-request-id": record.request_id})

    async def get_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        owner = request_owner(request.scope)
        stream = request.query_params.get("stream", "").lower() == "true"
        after = _starting_after(request.query_params.get("starting_after")) if stream else -1
        running = services()
        rec = await running.require_store().get(rid, owner=owner)
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        if not stream:
            return OrjsonResponse(rec.response)
        runs = running.background
        if runs is None or rec.response.get("background") is not True:
            raise InvalidRequest("Only responses created with background=true can be streamed.", param="stream",
                                 code="unsupported_parameter")
        # Its stored events after starting_after, then the live ones until the terminal event, from any replica.
        record.stream = True
        return SseResponse(runs.follow(rid, after, owner), on_disconnect=lambda: _left(record))

    async def delete_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        if not await services().require_store().delete(rid, owner=request_owner(request.scope)):
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        return OrjsonResponse({"id": rid, "object": "response", "deleted": True})

    async def cancel_response(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        owner = request_owner(request.scope)
        running = services()
        store = running.require_store()
        runs = running.background
        # A background response still running is cancelled on whichever replica runs it; idempotent.
        rec = await runs.cancel(rid, owner) if runs is not None else await store.get(rid, owner=owner)
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        if rec.response.get("background") is not True:
            raise InvalidRequest("Only responses created with background=true can be cancelled.",
                                 param="response_id", code="invalid_request")
        return OrjsonResponse(rec.response)

    async def count_input_tokens(request: Request, record: RequestRecord) -> Response:
        """``POST /v1/responses/input_tokens``: the request's input tokens as vLLM counts them (the engine's
        meter), with its history loaded as for a response, for the caller's own stored state only."""
        handler = services().responses
        raw = await read_body(request, handler.settings.max_body_bytes)
        record.request_bytes = len(raw)
        body = parse_request_body(raw)
        record.model = body.get("model") if isinstance(body.get("model"), str) else None
        n = await handler.input_tokens(body, dict(request.headers), request_owner(request.scope))
        return OrjsonResponse({"object": "response.input_tokens", "input_tokens": n})

    async def list_input_items(request: Request, record: RequestRecord) -> Response:
        rid = request.path_params["response_id"]
        rec = await services().require_store().get(rid, owner=request_owner(request.scope))
        if rec is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        # in the SDK's item shapes (a string content, an output without status, …), whenever they were stored
        return OrjsonResponse(paginate([listed_item(i) for i in rec.input_items], request.query_params))

    return [
        Route("/v1/responses", wrap("/v1/responses", create_response), methods=["POST"]),
        Route("/v1/responses/compact", wrap("/v1/responses/compact", compact_response), methods=["POST"]),
        Route("/v1/responses/input_tokens", wrap("/v1/responses/input_tokens", count_input_tokens),
              methods=["POST"]),
        Route("/v1/responses/{response_id}", wrap("/v1/responses/{id}", get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", wrap("/v1/responses/{id}", delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", wrap("/v1/responses/{id}/input_items", list_input_items),
              methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", wrap("/v1/responses/{id}/cancel", cancel_response),
              methods=["POST"]),
    ]


def _left(record: RequestRecord) -> None:
    record.disconnected = True


def paginate(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """OpenAI's list shape over stored input items: ``limit`` (1-100), ``order``, ``after``, ``before``."""
    limit, order = list_query(query)
    seq = list(items) if order == "asc" else list(reversed(items))
    ids = [i.get("id") for i in seq]
    for key in ("after", "before"):
        cursor = query.get(key)
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"No input item with id '{cursor}'.", param=key, code="invalid_value")
    if query.get("after") is not None:
        seq = seq[ids.index(query["after"]) + 1 :]
    if query.get("before") is not None:
        ids = [i.get("id") for i in seq]
        seq = seq[: ids.index(query["before"])] if query["before"] in ids else seq
        seq = seq[-limit:]
    page = seq[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(seq) > len(page),
    }


def _starting_after(raw: str | None) -> int:
    """``starting_after`` of ``GET /v1/responses/{id}?stream=true``: a sequence number (-1 or absent: from the
    first event)."""
    if raw is None or raw == "":
        return -1
    if not _INTEGER.fullmatch(raw):
        raise InvalidRequest("'starting_after' must be an integer.", param="starting_after", code="invalid_type")
    value = int(raw)
    # Sequence numbers are stored as 64-bit integers: a larger cursor would overflow the store's query.
    if not -1 <= value <= _MAX_SEQUENCE:
        raise InvalidRequest(f"'starting_after' must be between -1 and {_MAX_SEQUENCE}.", param="starting_after",
                             code="invalid_value")
    return value


_INTEGER = re.compile(r"-?[0-9]{1,20}")
_MAX_SEQUENCE = 2**63 - 1
