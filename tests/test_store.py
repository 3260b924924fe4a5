"""Behavioural tests of the response stores, run against SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import asyncpg
import orjson
import pytest

from gateway.store import (
    BrokenChainError,
    ChainTooDeepError,
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoredResponse,
    open_store,
    run_sweeper,
)
from gateway.store.postgres import MIGRATIONS as PG_MIGRATIONS

REPO_ROOT = Path(__file__).resolve().parent.parent
PG_DSN = os.environ.get("GATEWAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


async def require_postgres() -> None:
    """Fail loudly when PostgreSQL is down: a silently skipped backend is an untested backend."""
    try:
        conn = await asyncpg.connect(PG_DSN, timeout=5)
    except Exception as exc:
        if os.environ.get("GATEWAY_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"PostgreSQL at {PG_DSN} unavailable and GATEWAY_TEST_SKIP_POSTGRES=1")
        pytest.fail(
            f"PostgreSQL at {PG_DSN} did not answer ({exc!r}). Start it, point "
            "GATEWAY_TEST_POSTGRES_DSN at one, or set GATEWAY_TEST_SKIP_POSTGRES=1 to skip explicitly.",
            pytrace=False,
        )
    await conn.close()


async def drop_schema(schema: str) -> None:
    conn = await asyncpg.connect(PG_DSN)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    """A fresh schema name (the store creates it); dropped afterwards."""
    await require_postgres()
    schema = f"test_store_{uuid.uuid4().hex[:12]}"
    yield schema
    await drop_schema(schema)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ResponseStore]:
    if request.param == "sqlite":
        # A nested path checks that the parent directories are created.
        lite = SqliteResponseStore(tmp_path / "nested" / "dir" / "responses.db")
        await lite.start()
        yield lite
        await lite.close()
        return
    await require_postgres()
    schema = f"test_store_{uuid.uuid4().hex[:12]}"
    pg = PostgresResponseStore(PG_DSN, schema=schema)
    try:
        await pg.start()
        yield pg
        await pg.close()
    finally:
        await drop_schema(schema)


def record(
    rid: str,
    prev: str | None = None,
    created_at: int = 1_700_000_000,
    status: str = "completed",
    text: str = "hello",
) -> StoredResponse:
    return StoredResponse(
        id=rid,
        created_at=created_at,
        previous_response_id=prev,
        status=status,
        response={
            "id": rid,
            "object": "response",
            "created_at": created_at,
            "status": status,
            "model": "tiny",
            "previous_response_id": prev,
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{rid}",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 4},
            "metadata": {},
        },
        input_items=[{"type": "message", "id": f"msg_in_{rid}", "role": "user", "content": "hi"}],
        tool_context=None,
        updated_at=created_at,
    )


def realistic_record() -> StoredResponse:
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2  # ünïcödé ✓\n*** End Patch\n"
    tools = [
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Apply a patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/s'},
        },
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {}},
            "strict": True,
        },
    ]
    return StoredResponse(
        id="resp_0123456789abcdef",
        created_at=1_761_000_000,
        previous_response_id="resp_parent",
        status="completed",
        response={
            "id": "resp_0123456789abcdef",
            "object": "response",
            "created_at": 1_761_000_000,
            "status": "completed",
            "error": None,
            "incomplete_details": None,
            "model": "Qwen/Qwen3-0.6B",
            "output": [
                {"type": "reasoning", "id": "rs_abc", "summary": [], "content": None},
                {
                    "type": "custom_tool_call",
                    "id": "ctc_0123456789abcdef",
                    "call_id": "call_XYZ",
                    "name": "apply_patch",
                    "input": patch,
                    "status": "completed",
                },
            ],
            "usage": {
                "input_tokens": 1234,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": 56,
                "output_tokens_details": {"reasoning_tokens": 12},
                "total_tokens": 1290,
            },
            "metadata": {"session": "s-1", "emoji": "🚀"},
            "tools": tools,
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "parallel_tool_calls": False,
            "temperature": 0.7,
            "top_p": 1.0,
            "previous_response_id": "resp_parent",
        },
        input_items=[
            {
                "type": "message",
                "id": "msg_in_1",
                "role": "user",
                "content": [{"type": "input_text", "text": "fix a.py"}],
            },
            {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_prev", "output": "done"},
        ],
        tool_context={"grammars": {"apply_patch": "lark"}, "forced": ["apply_patch"], "n": 2.5},
        updated_at=1_761_000_042,
    )


async def test_round_trip(store: ResponseStore) -> None:
    rec = realistic_record()
    await store.put(rec)
    got = await store.get(rec.id)
    assert got == rec
    assert got is not None and got.response["output"][1]["id"].startswith("ctc_")
    # Exact JSON equality (no float/int/unicode drift through either backend's encoding).
    assert orjson.dumps(got.response, option=orjson.OPT_SORT_KEYS) == orjson.dumps(
        rec.response, option=orjson.OPT_SORT_KEYS
    )


async def test_a_response_stored_before_cache_write_tokens_reads_back_with_it(store: ResponseStore) -> None:
    """Usage as the newest openai SDK requires it, for rows written before the gateway sent it: made on read."""
    rec = realistic_record()
    old_usage = {**rec.response["usage"], "input_tokens_details": {"cached_tokens": 7}}
    await store.put(dataclasses.replace(rec, previous_response_id=None,
                                        response={**rec.response, "usage": old_usage}))
    got = await store.get(rec.id)
    assert got is not None and got.response["usage"]["input_tokens_details"] == {"cached_tokens": 7,
                                                                               "cache_write_tokens": 0}
    assert {k: v for k, v in got.response.items() if k != "usage"} == {
        k: v for k, v in rec.response.items() if k != "usage"}
    [chained] = await store.get_chain(rec.id)
    assert chained.response["usage"] == got.response["usage"]


async def test_items_by_id_for_item_reference(store: ResponseStore) -> None:
    rec = realistic_record()
    await store.put(rec)
    got = await store.get_items(["ctc_0123456789abcdef", "msg_in_1", "rs_abc", "ctco_1", "nope"])
    assert set(got) == {"ctc_0123456789abcdef", "msg_in_1", "rs_abc", "ctco_1"}
    assert got["ctc_0123456789abcdef"] == rec.response["output"][1]
    assert got["msg_in_1"] == rec.input_items[0]
    assert await store.get_items([]) == {}
    # the items go with their response
    assert await store.delete(rec.id)
    assert await store.get_items(["msg_in_1", "ctc_0123456789abcdef"]) == {}
    await store.put(dataclasses.replace(rec, created_at=10))
    assert await store.sweep(older_than=11) == 1
    assert await store.get_items(["msg_in_1"]) == {}


async def test_put_replaces(store: ResponseStore) -> None:
    await store.put(record("resp_1", status="in_progress", text="partial"))
    final = record("resp_1", status="completed", text="complete answer")
    final = dataclasses.replace(final, updated_at=final.updated_at + 5, tool_context={"step": 2})
    await store.put(final)
    assert await store.get("resp_1") == final
    assert await store.get_chain("resp_1") == [final]


async def test_unknown_ids(store: ResponseStore) -> None:
    assert await store.get("resp_nope") is None
    assert await store.get_chain("resp_nope") == []
    assert await store.delete("resp_nope") is False


async def test_chain_oldest_first(store: ResponseStore) -> None:
    a, b, c = record("resp_a"), record("resp_b", "resp_a"), record("resp_c", "resp_b")
    for r in (c, a, b):  # insertion order must not matter
        await store.put(r)
    assert await store.get_chain("resp_c") == [a, b, c]
    assert await store.get_chain("resp_b") == [a, b]
    assert await store.get_chain("resp_a") == [a]


async def test_chain_is_two_queries_whatever_its_length(tmp_path: Path) -> None:
    # One recursive query measures the chain (ids and sizes, for the history bound), one loads its records.
    s = SqliteResponseStore(tmp_path / "r.db")
    await s.start()
    try:
        for i in range(10):
            await s.put(record(f"resp_{i}", f"resp_{i - 1}" if i else None))
        statements: list[str] = []
        assert s._db is not None
        s._db.set_trace_callback(statements.append)
        chain = await s.get_chain("resp_9")
        assert [r.id for r in chain] == [f"resp_{i}" for i in range(10)]
        queries = [q for q in statements if q not in ("BEGIN", "COMMIT")]
        assert len(queries) == 2 and "WITH RECURSIVE" in queries[0]
    finally:
        await s.close()


async def test_parent_with_two_children(store: ResponseStore) -> None:
    a = record("resp_a")
    b1, b2 = record("resp_b1", "resp_a", text="one"), record("resp_b2", "resp_a", text="two")
    await asyncio.gather(store.put(a), store.put(b1), store.put(b2))
    assert await store.get_chain("resp_b1") == [a, b1]
    assert await store.get_chain("resp_b2") == [a, b2]


async def test_broken_chain(store: ResponseStore) -> None:
    for r in (record("resp_a"), record("resp_b", "resp_a"), record("resp_c", "resp_b")):
        await store.put(r)
    assert await store.delete("resp_b") is True
    with pytest.raises(BrokenChainError) as info:
        await store.get_chain("resp_c")
    assert info.value.missing_id == "resp_b"
    assert [r.id for r in await store.get_chain("resp_a")] == ["resp_a"]


async def test_chain_depth_bound(store: ResponseStore) -> None:
    for i in range(5):
        await store.put(record(f"resp_{i}", f"resp_{i - 1}" if i else None))
    assert len(await store.get_chain("resp_4", max_depth=5)) == 5
    with pytest.raises(ChainTooDeepError):
        await store.get_chain("resp_4", max_depth=4)
    # A cycle (impossible through the gateway, possible in a hand-edited database) must terminate.
    await store.put(record("resp_x", "resp_y"))
    await store.put(record("resp_y", "resp_x"))
    with pytest.raises(ChainTooDeepError):
        await store.get_chain("resp_x", max_depth=50)


async def test_delete(store: ResponseStore) -> None:
    await store.put(record("resp_a"))
    await store.put(record("resp_b", "resp_a"))
    assert await store.delete("resp_b") is True
    assert await store.get("resp_b") is None
    assert await store.delete("resp_b") is False
    assert await store.get("resp_a") is not None  # deleting a child leaves the parent


async def test_sweep(store: ResponseStore) -> None:
    for i, t in enumerate((100, 200, 300)):
        await store.put(record(f"resp_{i}", created_at=t))
    assert await store.sweep(250) == 2
    assert await store.get("resp_0") is None and await store.get("resp_1") is None
    assert await store.get("resp_2") is not None
    assert await store.sweep(300) == 0  # strictly older than
    assert await store.sweep(301) == 1


async def test_concurrent_puts(store: ResponseStore) -> None:
    records = [record(f"resp_{i:02d}", f"resp_{i - 1:02d}" if i else None, text=f"t{i}") for i in range(50)]
    await asyncio.gather(*(store.put(r) for r in records))
    got = await asyncio.gather(*(store.get(r.id) for r in records))
    assert got == records
    assert await store.get_chain("resp_49") == records


async def test_start_is_idempotent(store: ResponseStore, request: pytest.FixtureRequest) -> None:
    await store.start()
    await store.put(record("resp_a"))
    # A second store over the same database (another process, a restart) migrates nothing and sees the data.
    other: ResponseStore
    if isinstance(store, SqliteResponseStore):
        other = SqliteResponseStore(store.path)
    else:
        assert isinstance(store, PostgresResponseStore)
        other = PostgresResponseStore(PG_DSN, schema=store.schema)
    await other.start()
    try:
        assert await other.get("resp_a") == record("resp_a")
    finally:
        await other.close()


@pytest.mark.postgres
async def test_postgres_concurrent_migration_in_process(pg_schema: str) -> None:
    stores = [PostgresResponseStore(PG_DSN, schema=pg_schema, max_size=2) for _ in range(6)]
    await asyncio.gather(*(s.start() for s in stores))
    try:
        await stores[0].put(record("resp_a"))
        assert await stores[5].get("resp_a") == record("resp_a")
        conn = await asyncpg.connect(PG_DSN)
        try:
            rows = await conn.fetch(f'SELECT version FROM "{pg_schema}".schema_version')
        finally:
            await conn.close()
        assert [r["version"] for r in rows] == [len(PG_MIGRATIONS)]
    finally:
        await asyncio.gather(*(s.close() for s in stores))


PG_CHILD = r"""
import asyncio, sys, time
import orjson
from gateway.store import PostgresResponseStore, StoredResponse

async def main(dsn: str, schema: str, role: str, start_at: float) -> None:
    store = PostgresResponseStore(dsn, schema=schema)
    time.sleep(max(0.0, start_at - time.time()))  # line both processes up on the migration
    await store.start()
    try:
        if role == "writer":
            prev = None
            for rid in ("resp_a", "resp_b", "resp_c"):
                await store.put(StoredResponse(rid, 1, prev, "completed", {"id": rid}, [], None, 1))
                prev = rid
            print("written")
        else:
            deadline = time.time() + 30
            while not (chain := await store.get_chain("resp_c")):
                if time.time() > deadline:
                    raise SystemExit("reader timed out")
                await asyncio.sleep(0.05)
            print(orjson.dumps([r.id for r in chain]).decode())
    finally:
        await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
"""


@pytest.mark.postgres
async def test_postgres_two_processes(pg_schema: str) -> None:
    start_at = time.time() + 2.0  # enough for both interpreters to import asyncpg
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PG_CHILD,
            PG_DSN,
            pg_schema,
            role,
            str(start_at),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for role in ("writer", "reader")
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout=60)
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()
    assert outs[0][0].decode().strip() == "written"
    assert orjson.loads(outs[1][0]) == ["resp_a", "resp_b", "resp_c"]


SQLITE_CHILD = r"""
import asyncio, os, signal, sys
from gateway.store import SqliteResponseStore, StoredResponse

async def main(path: str) -> None:
    store = SqliteResponseStore(path)
    await store.start()
    await store.put(StoredResponse("resp_durable", 5, None, "completed", {"id": "resp_durable"},
                                   [{"type": "message", "id": "msg_1", "role": "user", "content": "x"}],
                                   {"k": [1, 2]}, 6))
    print("ok", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit, no checkpoint

asyncio.run(main(sys.argv[1]))
"""


async def test_sqlite_put_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "data" / "responses.db"
    proc = subprocess.run(
        [sys.executable, "-c", SQLITE_CHILD, str(path)], cwd=REPO_ROOT, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert proc.stdout.decode() == "ok\n"
    s = SqliteResponseStore(path)
    await s.start()
    try:
        got = await s.get("resp_durable")
        assert got is not None
        assert got.tool_context == {"k": [1, 2]} and got.input_items[0]["id"] == "msg_1"
    finally:
        await s.close()


def test_open_store_urls(tmp_path: Path) -> None:
    assert open_store("none") is None
    rel = open_store("sqlite:///var/responses.db")
    assert isinstance(rel, SqliteResponseStore) and rel.path == Path("var/responses.db")
    absolute = open_store(f"sqlite:///{tmp_path}/r.db")  # tmp_path starts with "/": four slashes
    assert isinstance(absolute, SqliteResponseStore) and absolute.path == tmp_path / "r.db"
    assert absolute.path.is_absolute()
    for url in ("postgresql://u@h:5432/db", "postgres://u@h/db"):
        pg = open_store(url)
        assert isinstance(pg, PostgresResponseStore) and pg.dsn == url
    for bad in ("", "mysql://x/y", "sqlite://", "sqlite:///", "sqlite:///:memory:", "redis://h"):
        with pytest.raises(ValueError, match=r"store|sqlite"):
            open_store(bad)


class FakeStore:
    def __init__(self, fail_first: bool = False) -> None:
        self.cutoffs: list[int] = []
        self.fail_first = fail_first
        self.called = asyncio.Event()

    async def sweep(self, older_than: int) -> int:
        self.cutoffs.append(older_than)
        if len(self.cutoffs) >= 3:
            self.called.set()
        if self.fail_first and len(self.cutoffs) == 1:
            raise RuntimeError("database blip")
        return 0


@pytest.mark.parametrize("fail_first", [False, True])
async def test_sweeper_loops_until_cancelled(fail_first: bool) -> None:
    fake = FakeStore(fail_first=fail_first)
    task = asyncio.create_task(
        run_sweeper(cast(ResponseStore, fake), ttl_seconds=100, interval=0.01, now=lambda: 1000.7)
    )
    await asyncio.wait_for(fake.called.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.cutoffs[:3] == [900, 900, 900]


async def test_sweeper_against_store(store: ResponseStore) -> None:
    await store.put(record("resp_old", created_at=100))
    await store.put(record("resp_new", created_at=1000))
    clock: dict[str, Any] = {"t": 1200.0}
    task = asyncio.create_task(run_sweeper(store, ttl_seconds=500, interval=0.01, now=lambda: clock["t"]))
    try:
        deadline = time.monotonic() + 5
        while await store.get("resp_old") is not None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await store.get("resp_new") is not None
        clock["t"] = 1600.0  # time passes: the newer one expires too
        while await store.get("resp_new") is not None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_sqlite_upgrade_indexes_items_stored_before_the_item_table(tmp_path: Path) -> None:
    import sqlite3

    from gateway.store.sqlite import MIGRATIONS as SQLITE_MIGRATIONS

    path = tmp_path / "old.db"
    rec = realistic_record()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)")
    for statement in SQLITE_MIGRATIONS[0]:
        db.execute(statement)
    db.execute("INSERT INTO schema_version VALUES (1, 1)")
    db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (rec.id, rec.created_at, rec.updated_at, rec.previous_response_id, rec.status,
                orjson.dumps(rec.response).decode(), orjson.dumps(rec.input_items).decode(), None))
    db.close()
    store = SqliteResponseStore(path)
    await store.start()
    try:
        got = await store.get_items(["ctc_0123456789abcdef", "msg_in_1"])
        assert got["ctc_0123456789abcdef"]["input"] == rec.response["output"][1]["input"]
        assert got["msg_in_1"] == rec.input_items[0]
    finally:
        await store.close()



def _open_store_at(path: str, barrier: Any, results: Any) -> None:
    async def run() -> None:
        store = SqliteResponseStore(path)
        barrier.wait()
        try:
            await store.start()
            results.put("ok")
        except Exception as exc:  # reported to the test, which names it
            results.put(repr(exc))
        finally:
            await store.close()

    asyncio.run(run())


def test_two_processes_opening_a_new_sqlite_database_at_once_both_start(tmp_path: Path) -> None:
    # The workers of --workers N open a new database at the same moment: switching the journal mode to WAL needs
    # an exclusive lock, and SQLite answers "database is locked" at once there instead of calling the busy
    # handler (seen in about half of such starts before the retry).
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for attempt in range(10):
        path = str(tmp_path / f"fresh{attempt}.db")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_open_store_at, args=(path, barrier, results)) for _ in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(30)
        assert sorted(results.get(timeout=5) for _ in procs) == ["ok", "ok"]
