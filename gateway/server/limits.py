"""Limits: beyond ``--max-concurrency`` requests in flight the gateway answers 429 at once; the WebSocket and
background caps count the same way. With ``--workers N`` the counts are the gateway's, not one worker's.

Refusing instead of queueing keeps latency honest (a queued request would hold a client connection and
count against nobody), and ``Retry-After`` tells SDKs (which retry 429s) when to come back. A slot is held
until the response's last byte is sent, so a stream counts for its whole life, and it is taken only once the
request body has arrived (``gateway.server.http.buffer_body``): a client trickling its body holds none. A WebSocket
``response.create`` takes one from the same limiter for its response's life.

Counts live in a ``Tally``: plain integers in one process, or, under ``--workers N``, a ``SharedTally``: a file the
parent creates in its private directory before it forks, mapped by every worker. Each worker writes only its own
row (its requests, connections, background runs and their owners); a check sums the rows of all workers under an
``fcntl`` record lock, so two workers cannot both take the last slot. A worker that dies cannot leak its slots:
the kernel drops its lock with it, and the parent zeroes its row when it reaps it, before a replacement starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.engine.tally import BACKGROUND, CONCURRENCY, WEBSOCKETS, SharedTally, Tally
from gateway.errors import PayloadTooLarge, RateLimited

__all__ = ["BACKGROUND", "CONCURRENCY", "WEBSOCKETS", "ConcurrencyLimiter", "SharedTally", "Slot", "Tally",
           "limited_stream"]


class Slot:
    """One admitted request; ``release`` is idempotent so every exit path may call it."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter: ConcurrencyLimiter | None = limiter

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.tally.give(CONCURRENCY)
            self._limiter = None


class ConcurrencyLimiter:
    # Generation takes seconds, so "retry in about a second" is the honest hint.
    retry_after_s = 1

    def __init__(self, limit: int, tally: Tally | None = None) -> None:
        self.limit = limit
        self.tally = tally if tally is not None else Tally()

    @property
    def active(self) -> int:
        """Requests in flight in the whole gateway (every worker)."""
        return self.tally.total(CONCURRENCY)

    def acquire(self) -> Slot:
        if self.tally.take(CONCURRENCY, self.limit if self.limit > 0 else None) is not None:
            raise RateLimited(f"The gateway is handling its maximum of {self.limit} concurrent requests; "
                              f"retry shortly.", headers={"retry-after": str(self.retry_after_s)})
        return Slot(self)


async def limited_stream(body: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """A request body that raises 413 once more than ``limit`` bytes went through (chunked bodies have no
    Content-Length to check up front)."""
    seen = 0
    async for chunk in body:
        seen += len(chunk)
        if seen > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        yield chunk
