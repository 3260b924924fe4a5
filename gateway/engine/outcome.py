"""What the engine answers a request with, whichever door asked: a JSON answer or a stream of client events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.events import ClientEvent

__all__ = ["Answered", "Outcome", "Persist", "Streamed", "Turn"]

# Stores a response (and its conversation turn) before its terminal event goes out; raises StoreWriteFailed.
Persist = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Answered:
    """A JSON answer: a non-streamed Response (200) or an error in OpenAI's shape with its status."""

    payload: Any
    status: int = 200


@dataclass(frozen=True, slots=True)
class Streamed:
    """The client's events, in order, in batches (one write each), ending with the terminal event; each
    transport encodes them (SSE: gateway.protocol.sse.encode_events)."""

    events: AsyncIterator[list[ClientEvent]]


Outcome = Answered | Streamed


@dataclass
class Turn:
    """One response on a WebSocket connection: the connection's cache of recent responses, and what the
    response used (its history and input items, which the connection caches for the next turn)."""

    local_history: Callable[[str], list[dict[str, Any]] | None]
    history: list[dict[str, Any]] = field(default_factory=list)
    input_items: list[dict[str, Any]] = field(default_factory=list)
