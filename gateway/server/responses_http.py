"""``POST /v1/responses`` over HTTP: the body read (bounded, decompressed) and parsed, the producer's outcome as
a starlette response — SSE for a stream, JSON otherwise. Everything else lives in the transport-independent
producer (gateway.engine.respond)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.engine.outcome import Outcome, Streamed
from gateway.engine.record import RequestRecord
from gateway.engine.respond import ResponsesHandler
from gateway.protocol.request import parse_request_body
from gateway.server.auth import request_owner
from gateway.server.http import OrjsonResponse, SseResponse, read_body

__all__ = ["create_response", "http_response"]


async def create_response(handler: ResponsesHandler, request: Request, record: RequestRecord) -> Response:
    raw = await read_body(request, handler.settings.max_body_bytes)
    record.request_bytes = len(raw)
    body = parse_request_body(raw)
    outcome = await handler.respond(body, dict(request.headers), request_owner(request.scope), record)
    return http_response(outcome, record)


def http_response(outcome: Outcome, record: RequestRecord) -> Response:
    headers = {"x-request-id": record.request_id}
    if isinstance(outcome, Streamed):
        return SseResponse(outcome.events, headers=headers, on_disconnect=lambda: _mark_disconnect(record))
    return OrjsonResponse(outcome.payload, status_code=outcome.status, headers=headers)


def _mark_disconnect(record: RequestRecord) -> None:
    record.disconnected = True
