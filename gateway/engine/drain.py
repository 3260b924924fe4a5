"""The drain: how a shutdown ends the streams still running (gateway.server.shutdown drives it from the signal,
the pump and background runs read through ``Drain.guard``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from typing import Any, TypeVar

from gateway.errors import StreamFailure

__all__ = ["ABORT_GRACE", "Drain", "ShuttingDown"]

T = TypeVar("T")

# Time the failed frames get to reach clients after the abort, before uvicorn cancels what is left.
ABORT_GRACE = 5.0


class ShuttingDown(StreamFailure):
    """Raised inside a stream's upstream read once the drain period is over."""

    status = 503
    code = "gateway_shutting_down"

    def __init__(self, message: str = "The gateway is shutting down; the stream was ended after the drain period. "
                 "Retry the request.") -> None:
        super().__init__(message)


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.aborted = False
        self.began_at: float | None = None  # time.monotonic() of the first begin(): background runs' deadline
        self._reads: set[asyncio.Task[Any]] = set()
        self._cancelled: set[asyncio.Task[Any]] = set()
        self.on_abort: list[Callable[[], None]] = []  # once per stream ended by abort() (a metric)

    @property
    def active_reads(self) -> int:
        return len(self._reads)

    def begin(self) -> None:
        """Safe to call from a signal handler: it only sets flags."""
        self.draining = True
        if self.began_at is None:
            self.began_at = time.monotonic()

    def abort(self) -> None:
        """End every stream still reading from the upstream (must run on the event loop)."""
        self.draining = True
        self.aborted = True
        for task in list(self._reads):
            self._cancelled.add(task)
            task.cancel()

    async def guard(self, chunks: AsyncIterable[T]) -> AsyncGenerator[T, None]:
        """``chunks`` (upstream bytes or event batches), but raising ``ShuttingDown`` once ``abort()`` ran,
        even while an upstream read is pending (a model thinking for minutes must not hold the shutdown).

        The response pump does the same inline (``enter``/``leave``/``ours`` around its own read): a generator
        layer there would cost every frame.
        """
        iterator = chunks.__aiter__()
        task = asyncio.current_task()
        assert task is not None
        while True:
            self.enter(task)
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self.ours(task):
                    raise ShuttingDown from None
                raise
            finally:
                self.leave(task)
            yield chunk

    def enter(self, task: asyncio.Task[Any]) -> None:
        """Before a read: ``ShuttingDown`` if the drain is over, else the task may be cancelled by ``abort()``.

        ``abort()`` cancels the task while it waits in a read; the read's ``CancelledError`` is turned into
        ``ShuttingDown`` only when that cancellation is ours (``ours``). This costs a set insertion per read,
        where a cancel scope per read cost a measurable share of the frame path."""
        if self.aborted:
            self._aborted_one()
            raise ShuttingDown
        self._reads.add(task)

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._reads.discard(task)

    def ours(self, task: asyncio.Task[Any]) -> bool:
        """A read was cancelled: whether by ``abort()`` (and no other cancellation is pending), so the stream
        ends with ``ShuttingDown`` rather than being torn down."""
        if task not in self._cancelled:
            return False
        self._cancelled.discard(task)
        if task.uncancel() == 0:
            self._aborted_one()
            return True
        return False

    def _aborted_one(self) -> None:
        for callback in self.on_abort:
            callback()
