"""Concurrency limit: beyond ``--max-concurrency`` requests in flight the gateway answers 429 at once.

Refusing instead of queueing keeps latency honest (a queued request would hold a client connection and
count against nobody), and ``Retry-After`` tells SDKs (which retry 429s) when to come back. A slot is held
until the response's last byte is sent, so a stream counts for its whole life, and it is taken only once the
request body has arrived (``gateway.server.http.buffer_body``): a client trickling its body holds none. A WebSocket
``response.create`` takes one from the same limiter for its response's life.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.errors import PayloadTooLarge, RateLimited

__all__ = ["ConcurrencyLimiter", "Slot", "limited_stream"]


class Slot:
    """One admitted request; ``release`` is idempotent so every exit path may call it."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter: ConcurrencyLimiter | None = limiter

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.active -= 1
            self._limiter = None


class ConcurrencyLimiter:
    # Generation takes seconds, so "retry in about a second" is the honest hint.
    retry_after_s = 1

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> Slot:
        # Single-threaded event loop: check-and-increment cannot interleave with another request.
        if self.limit > 0 and self.active >= self.limit:
            raise RateLimited(f"The gateway is handling its maximum of {self.limit} concurrent requests; "
                              f"retry shortly.", headers={"retry-after": str(self.retry_after_s)})
        self.active += 1
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
