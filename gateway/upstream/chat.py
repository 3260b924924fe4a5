"""Upstream bodies as batches of upstream-style Responses events (one batch per upstream chunk).

The server's pump reads these batches whichever API answered: vLLM's /v1/responses SSE (events as sent)
or /v1/chat/completions SSE (chunks converted by ``ChatToResponsesEvents``, optionally rewritten first,
e.g. a constrained step's content turned into a call by ``ContentAsCall``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any, Protocol

import httpx
import orjson

from gateway.protocol.events import UpstreamEvent
from gateway.protocol.sse import SseParser
from gateway.translate.chat import ChatToResponsesEvents, completion_to_chunks
from gateway.upstream.client import UpstreamResponse

__all__ = ["chat_chunk_events", "chat_completion_events", "chat_event_batches", "responses_event_batches"]

ChunkRewrite = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class ChunkConverter(Protocol):
    """Chat chunks -> Responses events: ChatToResponsesEvents, or a takeover step's InputContinuation."""

    finished: bool

    def feed(self, chunk: Mapping[str, Any]) -> list[UpstreamEvent]: ...

    def done(self) -> list[UpstreamEvent]: ...


async def responses_event_batches(up: UpstreamResponse) -> AsyncGenerator[list[UpstreamEvent], None]:
    """vLLM's /v1/responses SSE as it arrives; a transport error mid-stream raises ``StreamFailure``."""
    parser = SseParser()
    try:
        async for chunk in up.aiter_bytes():
            events = parser.feed(chunk)
            if events:
                yield [UpstreamEvent(event, data) for event, data in events]
    except httpx.HTTPError as exc:
        raise up.stream_failure(exc) from None
    tail = parser.close()
    if tail:
        yield [UpstreamEvent(event, data) for event, data in tail]


def chat_chunk_events(data: str, conv: ChunkConverter,
                      rewrite: ChunkRewrite | None = None) -> list[UpstreamEvent]:
    """One chat SSE ``data:`` text (a chunk or ``[DONE]``) through a chunk converter."""
    if data[:1] != "{" and data.strip() == "[DONE]":  # a chunk is an object: only the end is stripped and compared
        return conv.done()
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        conv.finished = True
        return [UpstreamEvent.built({"type": "error", "code": "upstream_malformed_event",
                                     "message": "The upstream sent a chunk that is not valid JSON."})]
    if not isinstance(chunk, dict):
        return []
    return conv.feed(rewrite(chunk) if rewrite is not None and "error" not in chunk else chunk)


async def chat_event_batches(up: UpstreamResponse, conv: ChunkConverter,
                             rewrite: ChunkRewrite | None = None) -> AsyncGenerator[list[UpstreamEvent], None]:
    """Chat SSE (``data:`` lines only, ``[DONE]`` at the end) -> Responses event batches, one per read; a transport
    error mid-stream raises ``StreamFailure``."""
    parser = SseParser()
    try:
        async for raw in up.aiter_bytes():
            out: list[UpstreamEvent] = []
            for _event, data in parser.feed(raw):
                out += chat_chunk_events(data, conv, rewrite)
            if out:
                yield out
    except httpx.HTTPError as exc:
        raise up.stream_failure(exc) from None
    out = []
    for _event, data in parser.close():
        out += chat_chunk_events(data, conv, rewrite)
    out += conv.done()  # no [DONE]: still ends if a finish_reason came; otherwise the translator fails it
    if out:
        yield out


def chat_completion_events(payload: Mapping[str, Any], conv: ChatToResponsesEvents,
                           rewrite: ChunkRewrite | None = None) -> list[UpstreamEvent]:
    """A non-streamed chat completion -> the same event sequence a stream would give."""
    chunks: Iterable[Mapping[str, Any]] = completion_to_chunks(payload)
    out: list[UpstreamEvent] = []
    for chunk in chunks:
        out += conv.feed(rewrite(chunk) if rewrite is not None else chunk)
    return out + conv.done()
