"""Background responses (``background: true``): a run detached from the client, durable stream events, streams
resumable from any replica, cancellation from any replica, and leases so that a run whose replica died ends.

One ``BackgroundRuns`` registry per process (created by the app's lifespan, handed to the engine):

- ``start()`` answers the create call at once. It writes the response row as ``queued`` (so ``GET`` works
  immediately), leased to this replica, and runs ``produce({...body, "stream": True}, …)`` (the engine's
  respond, handed in: this module does not import it) in a task of its own: the client leaving (or never
  reading a stream) does not stop it. A streamed create is answered with a follower of that run, like
  ``GET …?stream=true``.
- The run takes the client events the producer yields (their objects are the stored rows: nothing is parsed
  back), and appends them to the store in batches (every ``FLUSH_SECONDS`` or ``FLUSH_EVENTS`` events, and at
  once for the terminal event). Live events also go to this process's followers through bounded queues; a
  follower that falls ``SUBSCRIBER_QUEUE`` events behind is dropped from the live feed and catches up from the store.
- The row's status follows ``queued → in_progress → completed | incomplete | failed | cancelled``: in_progress
  at the first event, the final status by the producer's persist step (before its terminal frame), and a
  final status is never replaced (the store drops later writes).
- Followers (``follow()``) replay the stored events after ``starting_after`` and then the live ones until the
  terminal event. For a run of another replica they wait on the store's notifications (PostgreSQL
  LISTEN/NOTIFY; SQLite: in-process, plus a poll every ``POLL_SECONDS`` for other processes) and re-read the
  store after each: a notification is a hint, never data.
- ``cancel()`` marks the row cancelled in the store (atomically; a run that already ended stays as it ended)
  and stops the run: here by cancelling its task (which closes its upstream request), elsewhere through the
  store's notification or, at the latest, that replica's next heartbeat. A cancelled stream ends after the
  last event the run produced: the SDK has no ``response.cancelled`` stream event, and a ``response.failed``
  would contradict the response's status; the response object (``GET``, the cancel answer) says
  ``cancelled``.
- Leases: each replica renews the leases of its runs every ``HEARTBEAT_SECONDS`` (expiry ``LEASE_SECONDS``)
  and, at start-up and every ``SWEEP_SECONDS``, marks the queued / in_progress responses whose lease expired
  (their replica was killed) ``failed`` with ``gateway_stopped``, appending a terminal ``response.failed``
  event so that their followers end. At shutdown the runs get the drain period (gateway.server.shutdown),
  then the ones still going are stopped and marked failed the same way before the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.engine.drain import ABORT_GRACE, Drain
from gateway.engine.history import public_input_items
from gateway.engine.outcome import Answered, Outcome, Streamed
from gateway.engine.record import RequestRecord
from gateway.engine.tally import BACKGROUND, Tally
from gateway.errors import GatewayError, InvalidRequest, RateLimited, ServiceUnavailable
from gateway.protocol.events import TERMINAL_TYPES as TERMINAL_EVENTS
from gateway.protocol.events import ClientEvent
from gateway.runtime import new_id
from gateway.store import ResponseStore, StoredResponse
from gateway.store.base import RUNNING_STATUSES
from gateway.translate.restore import build_request_state, restore_response
from gateway.translate.tool_context import resolve_tool_context
from gateway.translate.usage import public_event

log = structlog.get_logger("gateway.background")

__all__ = ["STOPPED_ERROR", "BackgroundPerKeyLimit", "BackgroundRuns", "RunIdentity"]

LEASE_SECONDS = 15.0
HEARTBEAT_SECONDS = 3.0
SWEEP_SECONDS = 10.0
FLUSH_SECONDS = 0.05
FLUSH_EVENTS = 64
SUBSCRIBER_QUEUE = 1024
POLL_SECONDS = 1.0
# A final row whose terminal event is not stored after this long (its replica died between the two
# writes): the follower ends with the stored response as that event.
TERMINAL_GRACE_SECONDS = 3.0
PAGE = 500

STOPPED_ERROR = {"code": "gateway_stopped",
                 "message": "The gateway that ran this response stopped before it finished."}


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """What a background run's response is known by before it starts: handed to ``produce``."""

    response_id: str
    created_at: int


# The producer of a run's response (the engine's respond, with the run's identity): no import of it here.
Produce = Callable[[dict[str, Any], Mapping[str, str], str | None, RequestRecord, RunIdentity], Awaitable[Outcome]]


def _row_event(row: dict[str, Any]) -> ClientEvent:
    """A stored row as the client event it was (rows are the events' objects: the background-run encoding)."""
    return ClientEvent.of(public_event(row))  # events stored before cache_write_tokens: today's usage shape


class _Subscriber:
    """One follower's live feed: events, None at the end or once dropped."""

    __slots__ = ("dropped", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ClientEvent | None] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self.dropped = False

    def offer(self, item: ClientEvent | None) -> None:
        if self.dropped:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:  # too slow: it reads the rest from the store
            self.dropped = True

    async def get(self) -> ClientEvent | None:
        if self.dropped and self.queue.empty():
            return None
        return await self.queue.get()


@dataclass(eq=False)
class _Run:
    identity: RunIdentity
    owner: str | None
    snapshot: dict[str, Any]  # the latest response object: queued, then each event's
    task: asyncio.Task[None] | None = None
    pending: list[ClientEvent] = field(default_factory=list)  # produced, not yet stored
    subscribers: set[_Subscriber] = field(default_factory=set)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: bool = False
    terminal_seen: bool = False
    stop_reason: str | None = None  # "cancel" (the store already says cancelled) or "shutdown"
    done: bool = False

    def subscribe(self) -> _Subscriber:
        sub = _Subscriber()
        for event in self.pending:  # not in the store yet: the follower gets them from here
            sub.offer(event)
        self.subscribers.add(sub)
        return sub

    def publish(self, item: ClientEvent | None) -> None:
        for sub in list(self.subscribers):
            sub.offer(item)
            if sub.dropped:
                self.subscribers.discard(sub)


class _Cursor:
    __slots__ = ("ended", "last", "progressed")

    def __init__(self, after: int) -> None:
        self.last = after
        self.ended = False
        self.progressed = False


class BackgroundPerKeyLimit(RateLimited):
    """429: the caller's key already runs ``--max-background-per-key`` background responses here."""


class BackgroundRuns:
    """The background runs of this process, and the followers of any replica's."""

    def __init__(self, store: ResponseStore, *, limit: int = 64, drain: Drain | None = None,
                 drain_timeout: float = 0.0, per_owner: int = 0, tally: Tally | None = None) -> None:
        self.store = store
        self.limit = limit
        self.per_owner = per_owner  # runs one owner (API key) may have at once here; 0: no per-owner bound
        # Runs counted for the caps: this process's, or every worker's under --workers N (gateway.server.limits).
        self.tally = tally if tally is not None else Tally()
        self.drain = drain
        self.drain_timeout = drain_timeout
        self.lease_owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.runs: dict[str, _Run] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.store.add_event_listener(self._on_notification)
        try:
            await self.store.listen()
        except Exception as exc:  # followers poll meanwhile; the sweeper retries
            log.warning("background_listen_failed", error=type(exc).__name__)
        try:
            await self.sweep_expired()
        except Exception as exc:
            log.warning("background_sweep_failed", error=type(exc).__name__)
        self._loops = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._sweeper())]

    async def close(self) -> None:
        """Shutdown: runs get what is left of the drain period when one is under way (after SIGTERM), then
        the ones still going are stopped and marked failed (``gateway_stopped``)."""
        self._closing = True
        drain = self.drain
        if self.runs and drain is not None and drain.draining and drain.began_at is not None:
            left = drain.began_at + max(0.0, self.drain_timeout) + ABORT_GRACE - time.monotonic()
            tasks = {run.task for run in self.runs.values() if run.task is not None}
            if tasks and left > 0:
                await asyncio.wait(tasks, timeout=left)
        tasks = set()
        for run in list(self.runs.values()):
            if run.task is not None and not run.task.done():
                run.stop_reason = run.stop_reason or "shutdown"
                run.task.cancel()
                tasks.add(run.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        for loop in self._loops:
            loop.cancel()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        self.store.remove_event_listener(self._on_notification)

    # ------------------------------------------------------------------ create

    async def start_run(self, produce: Produce, body: dict[str, Any], headers: Mapping[str, str],
                        owner: str | None, record: RequestRecord) -> Outcome:
        """``POST /v1/responses`` with ``background: true``: the queued Response (or, streamed, the run's events)
        at once; the run goes on in its own task."""
        if body.get("store") is False:
            raise InvalidRequest("Background responses must be stored: background=true cannot be combined with "
                                 "store=false.", param="background", code="invalid_value")
        if self._closing:
            raise ServiceUnavailable("The gateway is shutting down; retry on another instance.",
                                     code="gateway_shutting_down")
        identity = RunIdentity(new_id("resp"), int(time.time()))
        ctx = resolve_tool_context(body)  # a malformed tool is a 400 here, not a failed run
        state = build_request_state(body, ctx, response_id=identity.response_id, created_at=identity.created_at)
        queued = restore_response(None, state, output=[], status="queued")
        queued["usage"] = None
        # The slot is taken before the first await; given back where the run leaves self.runs (_forget).
        refused = self.tally.take(BACKGROUND, self.limit, owner if self.per_owner > 0 else None, self.per_owner)
        if refused == "total":
            raise RateLimited(f"This gateway is running its maximum of {self.limit} background responses; "
                              "retry shortly.", headers={"retry-after": "1"})
        if refused == "owner":
            # One key must not take every slot of the replica from the others.
            raise BackgroundPerKeyLimit(f"This API key is running its maximum of {self.per_owner} background "
                                        "responses on this gateway; retry shortly.", headers={"retry-after": "1"})
        run = _Run(identity, owner, queued)
        self.runs[identity.response_id] = run
        stored = StoredResponse(id=identity.response_id, created_at=identity.created_at,
                                previous_response_id=body.get("previous_response_id"), status="queued",
                                response=queued, input_items=public_input_items(body),
                                tool_context=ctx.describe(), updated_at=identity.created_at, owner=owner)
        run_record = RequestRecord(request_id=record.request_id, route="background", started=time.perf_counter())
        # Shielded: a client leaving while the row is written does not leave a row without its run.
        await asyncio.shield(self._launch(run, stored, produce, body, headers, run_record))
        record.response_status = "queued"
        log.info("background_started", response_id=identity.response_id, request_id=record.request_id)
        if body.get("stream"):
            return Streamed(self.follow(identity.response_id, -1, owner))
        return Answered(queued)

    async def _launch(self, run: _Run, stored: StoredResponse, produce: Produce, body: dict[str, Any],
                      headers: Mapping[str, str], record: RequestRecord) -> None:
        try:
            await self.store.create_background(stored, self.lease_owner, time.time() + LEASE_SECONDS)
        except BaseException:
            self._forget(stored.id)
            raise
        run.task = asyncio.create_task(self._run(run, produce, dict(body), dict(headers), record))

    def _forget(self, response_id: str) -> None:
        run = self.runs.pop(response_id, None)
        if run is not None:
            self.tally.give(BACKGROUND, run.owner if self.per_owner > 0 else None)

    # ------------------------------------------------------------------ the run

    async def _run(self, run: _Run, produce: Produce, body: dict[str, Any], headers: dict[str, str],
                   record: RequestRecord) -> None:
        rid = run.identity.response_id
        flusher = asyncio.create_task(self._flusher(run))
        frames: AsyncIterator[list[ClientEvent]] | None = None
        try:
            try:
                outcome = await produce({**body, "stream": True}, headers, run.owner, record, run.identity)
            except GatewayError as exc:  # refused before anything streamed (an unknown previous_response_id, …)
                await self._fail(run, exc.code or exc.type, exc.message)
                return
            if isinstance(outcome, Answered):  # the upstream's error before its stream started
                err = outcome.payload.get("error") if isinstance(outcome.payload, dict) else None
                err = err if isinstance(err, dict) else {}
                await self._fail(run, str(err.get("code") or "upstream_error"),
                                 str(err.get("message") or f"The upstream answered HTTP {outcome.status}."))
                return
            frames = outcome.events
            async for batch in frames:
                for event in batch:
                    await self._event(run, event)
            if run.terminal_seen:
                await self._flush(run)
                # Normally a no-op (the persist step already wrote the final row); covers a failed store write,
                # which would otherwise leave the row in_progress until its lease is swept.
                await self._safe(self.store.set_status(rid, str(run.snapshot.get("status")), run.snapshot,
                                                       lease_owner=self.lease_owner))
            else:
                await self._fail(run, "server_error", "The response ended without a terminal event.")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled: the writes below run as usual
            if frames is not None:
                await _aclose(frames)  # the producer's finally closes the upstream request (vLLM stops)
            await self._flush(run)
            if run.stop_reason != "cancel":  # shutdown: this replica will not finish it
                await self._fail(run, STOPPED_ERROR["code"], STOPPED_ERROR["message"])
        except Exception as exc:
            log.error("background_run_failed", response_id=rid, error=type(exc).__name__)
            await self._fail(run, "server_error", "The gateway failed while running this background response.")
        finally:
            if frames is not None:
                await _aclose(frames)
            flusher.cancel()
            run.done = True
            self._forget(rid)
            run.publish(None)
            self._wake(rid)
            log.info("background_ended", response_id=rid, status=run.snapshot.get("status"),
                     stop=run.stop_reason)

    async def _event(self, run: _Run, event: ClientEvent) -> None:
        terminal = event.terminal
        response = event.payload.get("response")
        if isinstance(response, dict):
            run.snapshot = response
        run.pending.append(event)
        run.publish(event)
        if not run.started and isinstance(response, dict):
            run.started = True
            await self._safe(self.store.set_status(run.identity.response_id, "in_progress", response,
                                                   lease_owner=self.lease_owner))
        if terminal:
            run.terminal_seen = True
            await self._flush(run)
        elif len(run.pending) >= FLUSH_EVENTS:
            await self._flush(run)
        else:
            run.dirty.set()

    async def _flusher(self, run: _Run) -> None:
        while True:
            await run.dirty.wait()
            await asyncio.sleep(FLUSH_SECONDS)
            if not await self._flush(run):
                await asyncio.sleep(0.5)  # the store is failing: retry, not spin

    async def _flush(self, run: _Run) -> bool:
        async with run.lock:
            if not run.pending:
                run.dirty.clear()
                return True
            batch = list(run.pending)
            try:
                await self.store.append_events(run.identity.response_id, [event.payload for event in batch])
            except Exception as exc:  # kept; the next flush retries
                log.warning("background_events_write_failed", response_id=run.identity.response_id,
                            error=type(exc).__name__)
                return False
            del run.pending[:len(batch)]
            if not run.pending:
                run.dirty.clear()
            return True

    async def _fail(self, run: _Run, code: str, message: str) -> None:
        """End the run as failed: the row and a terminal ``response.failed`` event, in one write."""
        await self._flush(run)
        response = {**run.snapshot, "status": "failed", "error": {"code": code, "message": message}}
        event: dict[str, Any] = {"type": "response.failed", "response": response}
        if await self._safe(self.store.set_status(run.identity.response_id, "failed", response, event=event,
                                                  lease_owner=self.lease_owner)):
            run.snapshot = response
            run.publish(_row_event(event))

    @staticmethod
    async def _safe(write: Any) -> bool:
        try:
            return bool(await write)
        except Exception as exc:
            log.warning("background_status_write_failed", error=type(exc).__name__)
            return False

    # ------------------------------------------------------------------ cancel

    async def cancel(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """``POST /v1/responses/{id}/cancel``: the row afterwards (None: not found). Idempotent."""
        rec = await self.store.request_cancel(response_id, owner=owner)
        if rec is not None and rec.status == "cancelled":
            run = self.runs.get(response_id)
            if run is not None:
                self._stop(run)
                if run.task is not None:
                    await asyncio.wait({run.task}, timeout=2.0)  # its upstream request closed before the answer
        return rec

    def _stop(self, run: _Run) -> None:
        if run.stop_reason is None and run.task is not None and not run.task.done():
            run.stop_reason = "cancel"
            run.task.cancel()

    def _on_notification(self, response_id: str, what: str) -> None:
        if what == "cancel":
            run = self.runs.get(response_id)
            if run is not None:
                self._stop(run)
        self._wake(response_id)

    def _wake(self, response_id: str) -> None:
        for waiter in self._waiters.get(response_id, ()):
            waiter.set()

    # ------------------------------------------------------------------ leases

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            ids = [rid for rid, run in self.runs.items() if run.task is not None and not run.done]
            if not ids:
                continue
            try:
                stop = await self.store.renew_leases(self.lease_owner, ids, time.time() + LEASE_SECONDS)
            except Exception as exc:
                log.warning("background_lease_renew_failed", error=type(exc).__name__, runs=len(ids))
                continue
            for rid in stop:  # cancelled from another process (SQLite), deleted, or taken over
                run = self.runs.get(rid)
                if run is not None and not run.terminal_seen:
                    self._stop(run)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            try:
                await self.store.listen()  # reopens a lost LISTEN connection
            except Exception as exc:
                log.warning("background_listen_failed", error=type(exc).__name__)
            try:
                await self.sweep_expired()
            except Exception as exc:
                log.warning("background_sweep_failed", error=type(exc).__name__)

    async def sweep_expired(self) -> int:
        """Mark the queued / in_progress responses whose lease expired failed (``gateway_stopped``)."""
        now = time.time()
        failed = 0
        for rid in await self.store.expired_leases(now):
            if rid in self.runs:  # ours, still running: the heartbeat renews it
                continue
            rec = await self.store.get(rid)
            if rec is None:
                continue
            response = {**rec.response, "status": "failed", "error": dict(STOPPED_ERROR)}
            event: dict[str, Any] = {"type": "response.failed", "response": response}
            if await self.store.set_status(rid, "failed", response, event=event, expired_before=now):
                failed += 1
                log.warning("background_lease_expired", response_id=rid)
        return failed

    # ------------------------------------------------------------------ followers

    async def follow(self, response_id: str, after: int, owner: str | None) -> AsyncIterator[list[ClientEvent]]:
        """The response's events after sequence number ``after`` (stored, then live), ending
        with its terminal event (a cancelled one: after its last event)."""
        cursor = _Cursor(after)
        waiter = asyncio.Event()
        self._waiters.setdefault(response_id, set()).add(waiter)
        final_since: float | None = None
        try:
            while True:
                run = self.runs.get(response_id)
                if run is not None and not run.done:
                    sub = run.subscribe()  # first: what is flushed meanwhile is in the store or the feed
                    try:
                        async for frame in self._replay(response_id, owner, cursor):
                            yield frame
                        if cursor.ended:
                            return
                        while (item := await sub.get()) is not None:
                            if item.sequence_number <= cursor.last:
                                continue
                            cursor.last = item.sequence_number
                            yield [item]
                            if item.terminal:
                                return
                    finally:
                        run.subscribers.discard(sub)
                    continue  # the run ended, or this follower fell behind: the store has the rest
                waiter.clear()
                async for frame in self._replay(response_id, owner, cursor):
                    yield frame
                if cursor.ended:
                    return
                if not cursor.progressed:
                    rec = await self.store.get(response_id, owner=owner)
                    if rec is None:
                        return  # deleted meanwhile
                    if rec.status not in RUNNING_STATUSES:
                        if rec.status == "cancelled":
                            return
                        if final_since is None:
                            if cursor.last >= 0 and not await self._pending_terminal(response_id, owner, cursor.last):
                                return  # the client already has the terminal event (or asked past the end)
                            # Final, its terminal event not stored yet: the run writes it right after the row.
                            final_since = time.monotonic()
                        elif time.monotonic() - final_since > TERMINAL_GRACE_SECONDS:
                            yield [_row_event({"type": f"response.{rec.status}",
                                               "sequence_number": cursor.last + 1, "response": rec.response})]
                            return
                    if self.drain is not None and self.drain.aborted:
                        return  # shutting down: the client resumes elsewhere with starting_after
                cursor.progressed = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wait(), POLL_SECONDS)
        finally:
            waiters = self._waiters.get(response_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[response_id]

    async def _pending_terminal(self, response_id: str, owner: str | None, last: int) -> bool:
        """Whether the stored event ``last`` (the follower's latest) exists and is not terminal."""
        at = await self.store.get_events(response_id, last - 1, owner=owner, limit=1)
        return bool(at) and at[0].get("sequence_number") == last and at[0].get("type") not in TERMINAL_EVENTS

    async def _replay(self, response_id: str, owner: str | None, cursor: _Cursor
                      ) -> AsyncIterator[list[ClientEvent]]:
        while True:
            page = await self.store.get_events(response_id, cursor.last, owner=owner, limit=PAGE)
            for event in page:
                seq = int(event.get("sequence_number", -1))
                if seq <= cursor.last:
                    continue
                cursor.last = seq
                cursor.progressed = True
                yield [_row_event(event)]
                if event.get("type") in TERMINAL_EVENTS:
                    cursor.ended = True
                    return
            if len(page) < PAGE:
                return


async def _aclose(frames: AsyncIterator[list[ClientEvent]]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
