"""Background responses (``background: true``): detached runs, durable events, resumable streams from any
replica, cancellation from any replica, leases — with the official ``openai`` SDK as the client, against
SQLite and the real PostgreSQL, in-thread gateways and real gateway processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.engine import background
from gateway.engine.background import STOPPED_ERROR, BackgroundRuns
from gateway.engine.outcome import Streamed
from gateway.engine.record import RequestRecord
from gateway.protocol.events import ClientEvent
from gateway.protocol.sse import encode_events
from gateway.store import PostgresResponseStore, ResponseStore, SqliteResponseStore, StoredResponse
from tests.invariants import check_stream
from tests.support import ROOT, free_port, fresh_pg_database, running_gateway, serve_in_thread, sse_events
from tests.vllm_frames import VllmStream

PG_DSN = os.environ.get("GATEWAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
KEY_A, KEY_B = "key-a", "key-b"


# --------------------------------------------------------------------------------------------- the upstream

@dataclass
class Paced:
    """vLLM's /v1/responses in its framing (tests/vllm_frames.py), one frame every ``delay`` seconds; frames
    after ``hold_after`` wait for ``release`` (a threading.Event). Records each request's fate: ``finished``
    (every frame sent) or ``closed`` (the gateway closed the connection first)."""

    deltas: int = 12
    delay: float = 0.02
    hold_after: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[dict[str, Any]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    stopping: bool = False

    def text(self) -> str:
        return "".join(f"w{i} " for i in range(self.deltas))

    def app(self) -> Starlette:
        async def responses(request: Request) -> Response:
            body = await request.json()
            n = len(self.requests)
            self.requests.append(body)
            stream = VllmStream(response_id=f"resp_up{n:04d}").start()
            stream.message(f"msg_{n:04d}", [f"w{i} " for i in range(self.deltas)]).complete()
            if not body.get("stream"):
                self.finished.append(n)
                return Response(stream.nonstream_body(), media_type="application/json")

            async def gen() -> AsyncIterator[bytes]:
                done = False
                try:
                    for i, frame in enumerate(stream.frames):
                        if self.hold_after is not None and i == self.hold_after:
                            while not self.release.is_set() and not self.stopping:
                                await asyncio.sleep(0.01)
                        elif i:
                            await asyncio.sleep(self.delay)
                        yield frame.encode()
                    done = True
                finally:
                    (self.finished if done else self.closed).append(n)

            return StreamingResponse(gen(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"])])


@pytest.fixture
def paced() -> Iterator[tuple[str, Paced]]:
    fake = Paced()
    with serve_in_thread(fake.app()) as (url, _server):
        try:
            yield url, fake
        finally:
            fake.stopping = True
            fake.release.set()


# --------------------------------------------------------------------------------------------- stores

def _require_postgres() -> None:
    async def ping() -> None:
        conn = await asyncpg.connect(PG_DSN, timeout=5)
        await conn.close()

    try:
        asyncio.run(ping())
    except Exception as exc:
        if os.environ.get("GATEWAY_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"PostgreSQL unavailable: {exc!r}")
        pytest.fail(f"PostgreSQL at {PG_DSN} did not answer ({exc!r}).", pytrace=False)


def _drop_schema(schema: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(PG_DSN)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    """A store (not started: the gateway's lifespan starts it, on the gateway's event loop)."""
    if request.param == "sqlite":
        yield SqliteResponseStore(tmp_path / "bg.db")
        return
    _require_postgres()
    schema = "bg_" + uuid.uuid4().hex[:12]
    try:
        yield PostgresResponseStore(PG_DSN, schema=schema)
    finally:
        _drop_schema(schema)


def sdk(url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def wait_status(client: openai.OpenAI, rid: str, statuses: tuple[str, ...], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        r = client.responses.retrieve(rid)
        seen.append(r.status)
        if r.status in statuses:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid} did not reach {statuses}; seen {seen[-5:]}")
        time.sleep(0.05)


def until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_stream(url: str, rid: str, after: int | None = None, key: str | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"stream": "true"}
    if after is not None:
        params["starting_after"] = after
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params=params, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.read())


# --------------------------------------------------------------------------------------------- one gateway

def test_background_polled_to_completed_while_the_upstream_streams_slowly(store: ResponseStore, paced: Any) -> None:
    upstream, fake = paced
    fake.delay = 0.05
    with running_gateway(upstream_url=upstream, store=store) as url:
        c = sdk(url)
        r = c.responses.create(model="tiny", input="count", background=True, metadata={"k": "v"})
        assert r.status == "queued" and r.background is True and r.output == [] and r.metadata == {"k": "v"}
        assert r.id.startswith("resp_") and r.model == "tiny"
        first = c.responses.retrieve(r.id)  # the row exists at once
        assert first.status in ("queued", "in_progress") and first.background is True
        seen = {first.status}
        while True:
            got = c.responses.retrieve(r.id)
            seen.add(got.status)
            if got.status == "completed":
                break
            time.sleep(0.05)
        assert "in_progress" in seen
        assert got.background is True and got.id == r.id
        assert got.output_text == fake.text()
        assert fake.requests[0]["stream"] is True and "background" not in fake.requests[0]
        events = raw_stream(url, r.id)  # a finished background response replays all its events
        check_stream(events)
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["background"] is True
        assert events[-1]["response"]["output"] == got.model_dump()["output"]
        tail = [e.sequence_number for e in c.responses.retrieve(r.id, stream=True, starting_after=5)]
        assert tail == list(range(6, len(events)))
        t0 = time.monotonic()  # after the terminal event: nothing, at once
        assert list(c.responses.retrieve(r.id, stream=True, starting_after=len(events) - 1)) == []
        assert time.monotonic() - t0 < 1.0


def test_streamed_background_keeps_running_after_the_client_leaves(store: ResponseStore, paced: Any) -> None:
    upstream, fake = paced
    fake.hold_after = 6
    with running_gateway(upstream_url=upstream, store=store) as url:
        c = sdk(url)
        stream = c.responses.create(model="tiny", input="x", background=True, stream=True)
        got = []
        for event in stream:
            got.append(event)
            if len(got) == 4:
                break
        stream.close()  # the client leaves
        assert got[0].type == "response.created" and got[0].response.background is True
        rid = got[0].response.id
        fake.release.set()
        done = wait_status(c, rid, ("completed",))
        assert done.output_text == fake.text() and fake.finished == [0] and fake.closed == []
        rest = list(c.responses.retrieve(rid, stream=True, starting_after=got[-1].sequence_number))
        assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
        assert rest[-1].type == "response.completed"


def test_cancel_stops_the_run_and_is_idempotent(store: ResponseStore, paced: Any) -> None:
    upstream, fake = paced
    fake.hold_after = 5
    with running_gateway(upstream_url=upstream, store=store) as url:
        c = sdk(url)
        r = c.responses.create(model="tiny", input="x", background=True)
        wait_status(c, r.id, ("in_progress",))
        until(lambda: len(raw_stream_prefix(url, r.id)) >= 4, what="the first events stored")
        cancelled = c.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and cancelled.id == r.id and cancelled.background is True
        until(lambda: fake.closed == [0], what="the upstream request closed")
        again = c.responses.cancel(r.id)
        assert again.status == "cancelled" and again.model_dump() == cancelled.model_dump()
        assert c.responses.retrieve(r.id).status == "cancelled"
        events = raw_stream(url, r.id)  # a cancelled stream ends after its last event (no terminal event)
        assert events and all(e["type"] not in ("response.completed", "response.failed") for e in events)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        fake.release.set()
        time.sleep(0.2)
        assert c.responses.retrieve(r.id).status == "cancelled"  # nothing later replaces the final status


def raw_stream_prefix(url: str, rid: str) -> list[bytes]:
    """The stored events so far of a running response (the stream read for a moment)."""
    lines: list[bytes] = []
    try:
        with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=0.3) as r:
            for line in r.iter_lines():
                if line.startswith("event:"):
                    lines.append(line.encode())
    except httpx.ReadTimeout:
        pass
    return lines


def test_refusals_and_the_bound(tmp_path: Path, paced: Any) -> None:
    upstream, fake = paced
    fake.hold_after = 3
    with running_gateway(upstream_url=upstream, store=SqliteResponseStore(tmp_path / "r.db"),
                         max_background_responses=1) as url:
        c = sdk(url)
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model="tiny", input="x", background=True, store=False)
        assert exc.value.body["param"] == "background"  # type: ignore[index]
        assert exc.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        first = c.responses.create(model="tiny", input="x", background=True)
        with pytest.raises(openai.RateLimitError) as limited:
            c.responses.create(model="tiny", input="y", background=True)
        assert limited.value.response.headers.get("retry-after") == "1"
        c.responses.cancel(first.id)
        second = c.responses.create(model="tiny", input="y", background=True)  # the slot is free again
        fake.release.set()
        wait_status(c, second.id, ("completed",))
        plain = c.responses.create(model="tiny", input="z")
        assert plain.background in (None, False)
        assert httpx.get(f"{url}/v1/responses/{plain.id}", params={"stream": "true"}).status_code == 400
        cancel = httpx.post(f"{url}/v1/responses/{plain.id}/cancel")
        assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id"
        bad = httpx.get(f"{url}/v1/responses/{second.id}", params={"stream": "true", "starting_after": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    with running_gateway(upstream_url=upstream, store=None) as url:
        with pytest.raises(openai.BadRequestError) as exc:
            sdk(url).responses.create(model="tiny", input="x", background=True)
        assert exc.value.body["code"] == "store_disabled"  # type: ignore[index]


def test_an_unknown_previous_response_fails_the_run(tmp_path: Path, paced: Any) -> None:
    upstream, _fake = paced
    with running_gateway(upstream_url=upstream, store=SqliteResponseStore(tmp_path / "r.db")) as url:
        c = sdk(url)
        r = c.responses.create(model="tiny", input="x", background=True, previous_response_id="resp_nope")
        failed = wait_status(c, r.id, ("failed",))
        assert failed.error is not None and failed.error.code == "not_found"  # type: ignore[comparison-overlap]
        [event] = raw_stream(url, r.id)
        assert event["type"] == "response.failed"


def test_another_keys_retrieve_stream_and_cancel_are_404(store: ResponseStore, paced: Any) -> None:
    upstream, fake = paced
    fake.hold_after = 4
    with running_gateway(upstream_url=upstream, store=store, api_keys=(KEY_A, KEY_B),
                         owner_secret="s") as url:
        a, b = sdk(url, KEY_A), sdk(url, KEY_B)
        r = a.responses.create(model="tiny", input="x", background=True)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            list(b.responses.retrieve(r.id, stream=True))
        with pytest.raises(openai.NotFoundError):
            b.responses.cancel(r.id)
        assert a.responses.retrieve(r.id).status in ("queued", "in_progress")  # b's cancel changed nothing
        fake.release.set()
        wait_status(a, r.id, ("completed",))
        assert raw_stream(url, r.id, key=KEY_A)[-1]["type"] == "response.completed"


# --------------------------------------------------------------------------------------------- the store

async def test_store_background_methods(store: ResponseStore) -> None:
    await store.start()
    try:
        heard: list[tuple[str, str]] = []
        store.add_event_listener(lambda rid, what: heard.append((rid, what)))
        await store.listen()
        now = time.time()
        rid = "resp_bg" + uuid.uuid4().hex[:8]
        queued = {"id": rid, "object": "response", "status": "queued", "background": True, "output": []}
        rec = StoredResponse(id=rid, created_at=int(now), previous_response_id=None, status="queued",
                             response=queued, input_items=[{"id": "msg_in", "type": "message", "role": "user",
                                                            "content": "hi"}],
                             tool_context=None, updated_at=int(now), owner="o1")
        await store.create_background(rec, "me", now + 15)
        assert (await store.get(rid, owner="o1")).status == "queued"  # type: ignore[union-attr]
        events = [{"type": "response.created", "sequence_number": i, "n": i} for i in range(3)]
        await store.append_events(rid, events)
        await store.append_events(rid, [{"type": "x", "sequence_number": 2, "n": "dup"}])  # kept as it was
        assert [e["n"] for e in await store.get_events(rid, owner="o1")] == [0, 1, 2]
        assert [e["n"] for e in await store.get_events(rid, 0, owner="o1")] == [1, 2]
        assert await store.get_events(rid, owner="o2") == []
        assert await store.set_status(rid, "in_progress", {**queued, "status": "in_progress"}, lease_owner="me")
        assert not await store.set_status(rid, "failed", queued, lease_owner="other")
        assert await store.renew_leases("me", [rid, "resp_gone"], now + 30) == ["resp_gone"]
        assert await store.expired_leases(now + 20) == []
        assert await store.expired_leases(now + 31) == [rid]
        # A final status is final: neither set_status nor put() replaces it.
        assert await store.request_cancel(rid, owner="o2") is None
        cancelled = await store.request_cancel(rid, owner="o1")
        assert cancelled is not None and cancelled.status == "cancelled"
        assert cancelled.response["status"] == "cancelled"
        assert (await store.request_cancel(rid, owner="o1")).status == "cancelled"  # type: ignore[union-attr]
        assert await store.renew_leases("me", [rid], now + 30) == [rid]  # cancel requested: stop
        assert not await store.set_status(rid, "completed", queued)
        await store.put(StoredResponse(id=rid, created_at=int(now), previous_response_id=None, status="completed",
                                       response={**queued, "status": "completed"}, input_items=[], tool_context=None,
                                       updated_at=int(now), owner="o1"))
        assert (await store.get(rid)).status == "cancelled"  # type: ignore[union-attr]
        assert await store.expired_leases(now + 1000) == []
        # The lease sweep's write: failed plus a terminal event numbered after the last one, at once.
        rid2 = rid + "b"
        await store.create_background(StoredResponse(**{**_fields(rec), "id": rid2}), "dead", now - 1)
        await store.append_events(rid2, events)
        assert await store.expired_leases(now) == [rid2]
        event: dict[str, Any] = {"type": "response.failed", "response": {"status": "failed"}}
        assert await store.set_status(rid2, "failed", {"status": "failed"}, event=event, expired_before=now)
        assert event["sequence_number"] == 3
        assert [e["type"] for e in await store.get_events(rid2, 2)] == ["response.failed"]
        for _ in range(100):
            if (rid, "cancel") in heard and (rid2, "3") in heard:
                break
            await asyncio.sleep(0.02)
        assert (rid, "2") in heard and (rid, "cancel") in heard and (rid2, "3") in heard
        # Events go with their response.
        assert await store.delete(rid)
        assert await store.get_events(rid) == []
        assert await store.sweep(int(now) + 1) == 1
        assert await store.get_events(rid2) == []
    finally:
        await store.close()


def _fields(rec: StoredResponse) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in StoredResponse.__dataclass_fields__}


async def test_sweep_marks_expired_runs_failed_with_a_terminal_event(tmp_path: Path) -> None:
    st = SqliteResponseStore(tmp_path / "r.db")
    await st.start()
    try:
        now = time.time()
        response = {"id": "resp_dead", "object": "response", "status": "in_progress", "background": True}
        await st.create_background(StoredResponse(id="resp_dead", created_at=int(now), previous_response_id=None,
                                                   status="in_progress", response=response, input_items=[],
                                                   tool_context=None, updated_at=int(now)), "gone", now - 1)
        await st.append_events("resp_dead", [{"type": "response.created", "sequence_number": 0}])
        runs = BackgroundRuns(st)
        assert await runs.sweep_expired() == 1
        rec = await st.get("resp_dead")
        assert rec is not None and rec.status == "failed" and rec.response["error"] == STOPPED_ERROR
        frames = [encode_events(f) async for f in runs.follow("resp_dead", -1, None)]
        assert [f.split(b"\n", 1)[0] for f in frames] == [b"event: response.created", b"event: response.failed"]
        assert await runs.sweep_expired() == 0
    finally:
        await st.close()


async def test_a_final_row_without_its_terminal_event_ends_the_follower(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica died between the final row and the terminal event's write: the stored response stands in."""
    monkeypatch.setattr(background, "TERMINAL_GRACE_SECONDS", 0.2)
    monkeypatch.setattr(background, "POLL_SECONDS", 0.05)
    st = SqliteResponseStore(tmp_path / "r.db")
    await st.start()
    try:
        now = time.time()
        response = {"id": "resp_half", "object": "response", "status": "in_progress", "background": True,
                    "created_at": int(now), "model": "m", "output": [], "parallel_tool_calls": True,
                    "tool_choice": "auto", "tools": []}  # what the SDK's Response requires
        rec = StoredResponse(id="resp_half", created_at=int(now), previous_response_id=None, status="in_progress",
                             response=response, input_items=[], tool_context=None, updated_at=int(now))
        await st.create_background(rec, "gone", now + 15)
        await st.append_events("resp_half", [{"type": "response.created", "sequence_number": 0}])
        await st.put(StoredResponse(**{**_fields(rec), "status": "completed",
                                       "response": {**response, "status": "completed"}}))
        frames = [encode_events(f) async for f in BackgroundRuns(st).follow("resp_half", -1, None)]
        assert frames[-1].startswith(b"event: response.completed\n")
        assert b'"sequence_number":1' in frames[-1]
    finally:
        await st.close()


class _FastProducer:
    """A stand-in for the engine's respond: ``n`` events as fast as the consumer takes them."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def respond(self, body: dict[str, Any], headers: Any, owner: str | None, record: Any,
                      run: Any) -> Streamed:
        resp = {"id": run.response_id, "object": "response", "status": "in_progress", "background": True,
                "output": [], "created_at": 1, "model": "m", "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": []}  # what the SDK's Response requires

        async def frames() -> AsyncIterator[list[ClientEvent]]:
            yield [ClientEvent.of({"type": "response.created", "sequence_number": 0, "response": resp})]
            # several events per batch, as the pump yields what one upstream read carried
            yield [ClientEvent.of({"type": "response.output_text.delta", "sequence_number": i, "delta": f"{i} "})
                   for i in range(1, self.n - 1)]
            done = {**resp, "status": "completed"}
            yield [ClientEvent.of({"type": "response.completed", "sequence_number": self.n - 1, "response": done})]

        return Streamed(frames())


async def test_a_follower_that_falls_behind_is_dropped_and_catches_up_from_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "SUBSCRIBER_QUEUE", 4)
    st = SqliteResponseStore(tmp_path / "r.db")
    await st.start()
    runs = BackgroundRuns(st)
    await runs.start()
    try:
        n = 300
        outcome = await runs.start_run(_FastProducer(n).respond, {"model": "m", "input": "x", "stream": True,
                                                                   "background": True}, {}, None,
                                       RequestRecord(request_id="r", route="t"))
        assert isinstance(outcome, Streamed)
        follower = outcome.events
        first = encode_events(await follower.__anext__())
        assert first.startswith(b"event: response.created")
        [run] = runs.runs.values()
        assert run.task is not None
        await run.task  # the follower read nothing meanwhile: it was dropped from the live feed
        rest = [encode_events(f) async for f in follower]
        seqs = [orjson.loads(f.split(b"data: ", 1)[1])["sequence_number"] for f in [first, *rest]]
        assert seqs == list(range(n))
        assert rest[-1].startswith(b"event: response.completed")
        rid = orjson.loads(first.split(b"data: ", 1)[1])["response"]["id"]
        assert (await st.get(rid)).status == "completed"  # type: ignore[union-attr]
        assert len(await st.get_events(rid)) == n
    finally:
        await runs.close()
        await st.close()


def test_a_run_longer_than_its_lease_survives_another_replicas_sweeps(tmp_path: Path, paced: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    upstream, fake = paced
    monkeypatch.setattr(background, "LEASE_SECONDS", 0.6)
    monkeypatch.setattr(background, "HEARTBEAT_SECONDS", 0.1)
    monkeypatch.setattr(background, "SWEEP_SECONDS", 0.1)
    fake.delay = 0.1  # 2 s of frames: several leases long
    db = tmp_path / "shared.db"
    with running_gateway(upstream_url=upstream, store=SqliteResponseStore(db)) as url, \
            running_gateway(upstream_url=upstream, store=SqliteResponseStore(db)):
        c = sdk(url)
        r = c.responses.create(model="tiny", input="x", background=True)
        done = wait_status(c, r.id, ("completed", "failed"))
        assert done.status == "completed" and done.output_text == fake.text()


# --------------------------------------------------------------------------------------------- processes

def _process(upstream: str, store: str, port: int, log: Path, **env: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "GATEWAY_UPSTREAM_URL": upstream, "GATEWAY_PORT": str(port), "GATEWAY_STORE": store,
            "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_TOOL_CHOICE_ENFORCEMENT": "off", **env}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=full, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
            return proc
        except httpx.TransportError:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()) from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway did not start")


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def pg_store_url() -> Iterator[str]:
    """A fresh database on the test PostgreSQL as a gateway store URL (the gateway's tables live in its public
    schema, so each test gets its own database)."""
    _require_postgres()
    with fresh_pg_database(PG_DSN) as dsn:
        yield dsn


@pytest.mark.postgres
def test_stream_resumed_on_a_second_process_and_cancel_from_it(pg_store_url: str, paced: Any,
                                                               tmp_path: Path) -> None:
    upstream, fake = paced
    fake.hold_after = 8
    pa, pb = free_port(), free_port()
    a = _process(upstream, pg_store_url, pa, tmp_path / "a.log")
    b = _process(upstream, pg_store_url, pb, tmp_path / "b.log")
    try:
        ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        ca, cb = sdk(ua), sdk(ub)
        # 1. A streamed background response whose client leaves after 5 events, resumed from process B.
        stream = ca.responses.create(model="tiny", input="x", background=True, stream=True)
        got = []
        for event in stream:
            got.append(event)
            if len(got) == 5:
                break
        stream.close()
        rid = got[0].response.id
        n = got[-1].sequence_number
        resumed = cb.responses.retrieve(rid, stream=True, starting_after=n)
        tail = []
        for event in resumed:
            tail.append(event)
            if len(tail) == 2:  # B follows the live events of A's run: release the held frames now
                fake.release.set()
        assert [e.sequence_number for e in tail] == list(range(n + 1, n + 1 + len(tail)))
        assert tail[-1].type == "response.completed" and tail[-1].response.output_text == fake.text()
        full = raw_stream(ub, rid)
        check_stream(full)
        assert [(e["sequence_number"], e["type"]) for e in full[n + 1:]] == [(e.sequence_number, e.type) for e in tail]
        assert raw_stream(ua, rid, after=n) == full[n + 1:]  # exactly the events after n, from either process
        assert cb.responses.retrieve(rid).status == "completed" and fake.finished == [0]

        # 2. Cancel from process B stops process A's upstream request.
        fake.release.clear()
        fake.hold_after = 4
        r = ca.responses.create(model="tiny", input="y", background=True)
        until(lambda: len(fake.requests) == 2, what="A's run to reach the upstream")
        wait_status(cb, r.id, ("in_progress",))
        t0 = time.monotonic()
        cancelled = cb.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        until(lambda: fake.closed == [1], timeout=5, what="A to close its upstream request")
        assert time.monotonic() - t0 < 3
        assert ca.responses.retrieve(r.id).status == "cancelled"
        assert cb.responses.cancel(r.id).status == "cancelled"  # idempotent, from either
        assert ca.responses.cancel(r.id).status == "cancelled"
        # A follower on B of a response cancelled meanwhile ends after its last event.
        events = raw_stream(ub, r.id)
        assert events and events[-1]["type"] not in ("response.completed", "response.failed")
    finally:
        fake.release.set()
        _stop(a, b)


@pytest.mark.postgres
def test_a_follower_on_another_process_sees_the_cancel(pg_store_url: str, paced: Any, tmp_path: Path) -> None:
    upstream, fake = paced
    fake.hold_after = 4
    pa, pb = free_port(), free_port()
    a = _process(upstream, pg_store_url, pa, tmp_path / "a.log")
    b = _process(upstream, pg_store_url, pb, tmp_path / "b.log")
    try:
        ca, cb = sdk(f"http://127.0.0.1:{pa}"), sdk(f"http://127.0.0.1:{pb}")
        r = ca.responses.create(model="tiny", input="y", background=True)
        wait_status(cb, r.id, ("in_progress",))
        seen: list[Any] = []

        def follow() -> None:
            seen.extend(cb.responses.retrieve(r.id, stream=True))

        follower = threading.Thread(target=follow)
        follower.start()
        until(lambda: len(seen) >= 1 or not follower.is_alive(), what="the follower to start")
        time.sleep(0.3)
        ca.responses.cancel(r.id)
        follower.join(10)
        assert not follower.is_alive()
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        # The running process closes its upstream stream on the cancel; the follower may see the terminal event
        # (through the store) a moment before that close reaches the fake upstream.
        until(lambda: fake.closed == [0], what="the upstream stream to be closed")
    finally:
        fake.release.set()
        _stop(a, b)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_sigkill_then_restart_marks_the_response_failed(backend: str, paced: Any, tmp_path: Path) -> None:
    upstream, fake = paced
    fake.hold_after = 4
    if backend == "postgres":
        _require_postgres()
        with fresh_pg_database(PG_DSN) as dsn:
            _sigkill_then_restart(dsn, upstream, fake, tmp_path)
    else:
        _sigkill_then_restart(f"sqlite:///{tmp_path / 'kill.db'}", upstream, fake, tmp_path)


def _sigkill_then_restart(store: str, upstream: str, fake: Paced, tmp_path: Path) -> None:
    port = free_port()
    proc = _process(upstream, store, port, tmp_path / "a.log")
    url = f"http://127.0.0.1:{port}"
    try:
        c = sdk(url)
        r = c.responses.create(model="tiny", input="x", background=True)
        wait_status(c, r.id, ("in_progress",))
        until(lambda: len(raw_stream_prefix(url, r.id)) >= 4, what="the first events stored")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    t0 = time.monotonic()
    proc2 = _process(upstream, store, port, tmp_path / "b.log")
    try:
        failed = wait_status(sdk(url), r.id, ("failed",), timeout=60)
        assert time.monotonic() - t0 < 60
        assert failed.error is not None and failed.error.code == "gateway_stopped"  # type: ignore[comparison-overlap]
        assert failed.error.message == STOPPED_ERROR["message"]
        events = raw_stream(url, r.id)  # the resumed stream ends: a terminal response.failed was appended
        assert events[-1]["type"] == "response.failed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    finally:
        fake.release.set()
        _stop(proc2)


def test_sigterm_gives_background_runs_the_drain_period_then_fails_them(paced: Any, tmp_path: Path) -> None:
    upstream, fake = paced
    fake.hold_after = 4
    db = f"sqlite:///{tmp_path / 'term.db'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _process(upstream, db, port, tmp_path / "a.log", GATEWAY_DRAIN_TIMEOUT="1")
    try:
        c = sdk(url)
        finishing = c.responses.create(model="tiny", input="x", background=True)
        wait_status(c, finishing.id, ("in_progress",))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 >= 0.9  # the drain period was given
    finally:
        if proc.poll() is None:
            proc.kill()
    assert fake.closed == [0]
    proc2 = _process(upstream, db, port, tmp_path / "b.log")
    try:
        got = sdk(url).responses.retrieve(finishing.id)
        assert got.status == "failed" and got.error is not None
        assert got.error.code in ("gateway_shutting_down", "gateway_stopped")  # type: ignore[comparison-overlap]
        assert raw_stream(url, finishing.id)[-1]["type"] == "response.failed"
    finally:
        _stop(proc2)
