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

import fcntl
import hashlib
import mmap
import os
from collections.abc import AsyncIterator
from typing import Literal

from gateway.errors import PayloadTooLarge, RateLimited

__all__ = ["BACKGROUND", "CONCURRENCY", "WEBSOCKETS", "ConcurrencyLimiter", "SharedTally", "Slot", "Tally",
           "limited_stream"]

# What a tally counts: requests in flight, open WebSocket connections, background runs (these per owner too).
CONCURRENCY, WEBSOCKETS, BACKGROUND = 0, 1, 2
_KINDS = 3
Refusal = Literal["total", "owner"]


class Tally:
    """The counts of one process (a gateway with one worker). Single-threaded event loop: a check-and-take cannot
    interleave with another."""

    def __init__(self) -> None:
        self._counts = [0] * _KINDS
        self._owners: dict[str, int] = {}

    def take(self, kind: int, limit: int | None, owner: str | None = None, per_owner: int = 0) -> Refusal | None:
        """Count one more of ``kind`` unless ``limit`` (None: unbounded) is reached, or ``owner`` already holds
        ``per_owner`` (0: no bound) of them; what refused it, or None once it is counted."""
        if limit is not None and self._counts[kind] >= limit:
            return "total"
        if owner is not None and per_owner > 0 and self._owners.get(owner, 0) >= per_owner:
            return "owner"
        self._counts[kind] += 1
        if owner is not None:
            self._owners[owner] = self._owners.get(owner, 0) + 1
        return None

    def give(self, kind: int, owner: str | None = None) -> None:
        self._counts[kind] -= 1
        if owner is not None:
            left = self._owners.get(owner, 0) - 1
            if left > 0:
                self._owners[owner] = left
            else:
                self._owners.pop(owner, None)

    def total(self, kind: int) -> int:
        return self._counts[kind]

    def owned(self, owner: str) -> int:
        return self._owners.get(owner, 0)


def _owner_hash(owner: str) -> int:
    """A non-zero signed 64-bit hash of an owner (0 marks a free entry)."""
    value = int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=8).digest(), "little", signed=True)
    return value or 1


class SharedTally(Tally):
    """The counts of every worker of one gateway, in a shared file mapped by each of them.

    Layout: one row of 64-bit integers per worker: the three counts, then ``owner_entries`` pairs of (owner
    hash, background runs of that owner in this worker). A worker's runs have at most ``--max-background-responses``
    owners, so ``owner_entries`` = that cap (bounded) never runs out in practice; if it did, that run would go
    uncounted per owner, never refused for it.
    """

    MAX_OWNER_ENTRIES = 4096

    def __init__(self, path: str, workers: int, owner_entries: int) -> None:
        self.path = path
        self.workers = workers
        self.owner_entries = max(1, min(owner_entries, self.MAX_OWNER_ENTRIES))
        self._row = _KINDS + 2 * self.owner_entries
        self._fd = os.open(path, os.O_RDWR)
        self._mm = mmap.mmap(self._fd, 8 * self._row * workers)
        self._q = memoryview(self._mm).cast("q")
        self._mine = -1  # this worker's row; the parent (which only clears rows) has none

    @classmethod
    def create(cls, directory: str, workers: int, owner_entries: int) -> SharedTally:
        """The parent's: a zeroed file (0600) in its private directory."""
        path = os.path.join(directory, "limits")
        entries = max(1, min(owner_entries, cls.MAX_OWNER_ENTRIES))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 8 * (_KINDS + 2 * entries) * workers)
        finally:
            os.close(fd)
        return cls(path, workers, owner_entries)

    def attach(self, worker: int) -> None:
        """In worker ``worker`` (0-based), after the fork: the row it writes."""
        self._mine = worker * self._row

    def _lock(self) -> None:
        # A POSIX record lock: per process (a forked worker does not share its parent's), dropped by the kernel
        # when its holder dies, so a worker killed inside the few instructions it holds it blocks nobody.
        fcntl.lockf(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _sum(self, kind: int) -> int:
        q, row = self._q, self._row
        return sum(q[r * row + kind] for r in range(self.workers))

    def _owned(self, key: int) -> int:
        q, row, found = self._q, self._row, 0
        for r in range(self.workers):
            base = r * row + _KINDS
            for e in range(self.owner_entries):
                if q[base + 2 * e] == key:
                    found += q[base + 2 * e + 1]
        return found

    def take(self, kind: int, limit: int | None, owner: str | None = None, per_owner: int = 0) -> Refusal | None:
        if self._mine < 0:
            raise RuntimeError("SharedTally.take before attach()")
        self._lock()
        try:
            if limit is not None and self._sum(kind) >= limit:
                return "total"
            key = _owner_hash(owner) if owner is not None else 0
            if key and per_owner > 0 and self._owned(key) >= per_owner:
                return "owner"
            q = self._q
            q[self._mine + kind] += 1
            if key:
                self._add_owner(key, 1)
            return None
        finally:
            self._unlock()

    def give(self, kind: int, owner: str | None = None) -> None:
        self._lock()
        try:
            self._q[self._mine + kind] -= 1
            if owner is not None:
                self._add_owner(_owner_hash(owner), -1)
        finally:
            self._unlock()

    def _add_owner(self, key: int, delta: int) -> None:
        q, base = self._q, self._mine + _KINDS
        free = -1
        for e in range(self.owner_entries):
            at = base + 2 * e
            if q[at] == key:
                q[at + 1] += delta
                if q[at + 1] <= 0:
                    q[at] = q[at + 1] = 0
                return
            if free < 0 and q[at] == 0:
                free = at
        if delta > 0 and free >= 0:
            q[free], q[free + 1] = key, delta

    def total(self, kind: int) -> int:
        self._lock()
        try:
            return self._sum(kind)
        finally:
            self._unlock()

    def owned(self, owner: str) -> int:
        self._lock()
        try:
            return self._owned(_owner_hash(owner))
        finally:
            self._unlock()

    def clear(self, worker: int) -> None:
        """The parent's, once worker ``worker`` exited: what it held is free again."""
        self._lock()
        try:
            start = worker * self._row
            self._q[start:start + self._row] = memoryview(bytes(8 * self._row)).cast("q")
        finally:
            self._unlock()

    def close(self) -> None:
        self._q.release()
        self._mm.close()
        os.close(self._fd)


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
