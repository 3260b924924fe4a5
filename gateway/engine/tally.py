"""Counts the caps share: requests in flight, open WebSocket connections, background runs (these per owner too).

A ``Tally`` is plain integers in one process; under ``--workers N`` a ``SharedTally``: a file the parent creates in
its private directory before it forks, mapped by every worker. Each worker writes only its own row (its requests,
connections, background runs and their owners); a check sums the rows of all workers under an ``fcntl`` record
lock, so two workers cannot both take the last slot. A worker that dies cannot leak its slots: the kernel drops its
lock with it, and the parent zeroes its row when it reaps it, before a replacement starts. Here, in the engine,
because background runs count through it too; the doors (gateway.server.limits) use it for their caps.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
from typing import Literal

__all__ = ["BACKGROUND", "CONCURRENCY", "WEBSOCKETS", "Refusal", "SharedTally", "Tally"]

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
