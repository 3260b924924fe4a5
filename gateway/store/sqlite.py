"""SQLite ResponseStore: stdlib sqlite3 in worker threads, one connection behind a lock."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.store.base import (
    DEFAULT_MAX_CHAIN_DEPTH,
    ResponseStore,
    StoredResponse,
    StoreError,
    check_chain,
    record_items,
)

T = TypeVar("T")

# MIGRATIONS[n] takes the schema from version n to n + 1. Append only; never edit a released one.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE IF NOT EXISTS responses (
            id TEXT PRIMARY KEY,
            created_at INTEGER NOT NULL,
            updated_at INTEGER NOT NULL,
            previous_response_id TEXT,
            status TEXT NOT NULL,
            response TEXT NOT NULL,
            input_items TEXT NOT NULL,
            tool_context TEXT
        )""",
        "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)",
        "CREATE INDEX IF NOT EXISTS responses_previous ON responses (previous_response_id)",
    ),
    (
        # Items by id, for item_reference inputs; rows go with their response (delete, sweep).
        """CREATE TABLE IF NOT EXISTS response_items (
            item_id TEXT PRIMARY KEY,
            response_id TEXT NOT NULL,
            item TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS response_items_response ON response_items (response_id)",
        """INSERT OR IGNORE INTO response_items (item_id, response_id, item)
           SELECT json_extract(j.value, '$.id'), r.id, j.value FROM responses r, json_each(r.input_items) j
           WHERE json_extract(j.value, '$.id') IS NOT NULL""",
        """INSERT OR IGNORE INTO response_items (item_id, response_id, item)
           SELECT json_extract(j.value, '$.id'), r.id, j.value FROM responses r, json_each(r.response, '$.output') j
           WHERE json_extract(j.value, '$.id') IS NOT NULL""",
    ),
]

_COLUMNS = "id, created_at, previous_response_id, status, response, input_items, tool_context, updated_at"

_CHAIN_SQL = f"""
WITH RECURSIVE chain(depth, {_COLUMNS}) AS (
    SELECT 0, {_COLUMNS} FROM responses WHERE id = ?
    UNION ALL
    SELECT c.depth + 1, r.id, r.created_at, r.previous_response_id, r.status, r.response,
           r.input_items, r.tool_context, r.updated_at
    FROM responses r JOIN chain c ON r.id = c.previous_response_id
    WHERE c.depth + 1 < ?
)
SELECT {_COLUMNS} FROM chain ORDER BY depth
"""


def _dumps(value: Any) -> str:
    # TEXT rather than BLOB so the file stays inspectable with the sqlite3 shell and json_extract().
    return orjson.dumps(value).decode()


def _row_to_record(row: tuple[Any, ...]) -> StoredResponse:
    return StoredResponse(
        id=row[0],
        created_at=row[1],
        previous_response_id=row[2],
        status=row[3],
        response=orjson.loads(row[4]),
        input_items=orjson.loads(row[5]),
        tool_context=None if row[6] is None else orjson.loads(row[6]),
        updated_at=row[7],
    )


class SqliteResponseStore(ResponseStore):
    """A single-file store for one host. Several processes may share the file (WAL + busy_timeout)."""

    def __init__(self, path: str | Path, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._db: sqlite3.Connection | None = None
        # sqlite3 connections are not safe for concurrent use; one lock keeps every call serial.
        self._lock = threading.Lock()
        self._closed = False

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            with self._lock:
                if self._db is None:
                    raise StoreError("SqliteResponseStore used before start() or after close()")
                return fn(self._db)

        return await asyncio.to_thread(call)

    async def start(self) -> None:
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        with self._lock:
            if self._closed:
                raise StoreError("SqliteResponseStore cannot be restarted after close()")
            if self._db is not None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, so each write statement is its own committed
            # transaction and multi-statement ones are explicit below.
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                db.execute("PRAGMA journal_mode = WAL")
                # NORMAL in WAL mode survives a killed process (not a power cut) at a fraction of FULL's cost.
                db.execute("PRAGMA synchronous = NORMAL")
                self._migrate(db)
            except BaseException:
                db.close()
                raise
            self._db = db

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        # BEGIN IMMEDIATE takes the write lock up front, so two processes starting at once
        # migrate one after the other instead of both reading version 0.
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version ("
                "id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)"
            )
            row = db.execute("SELECT version FROM schema_version WHERE id = 1").fetchone()
            version = 0 if row is None else int(row[0])
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"database schema version {version} is newer than this gateway knows "
                    f"({len(MIGRATIONS)}); upgrade the gateway"
                )
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    db.execute(statement)
            db.execute(
                "INSERT INTO schema_version (id, version) VALUES (1, ?) "
                "ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                (len(MIGRATIONS),),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def close(self) -> None:
        def close_sync() -> None:
            with self._lock:
                self._closed = True
                if self._db is not None:
                    self._db.close()
                    self._db = None

        await asyncio.to_thread(close_sync)

    async def put(self, record: StoredResponse) -> None:
        params = (
            record.id,
            record.created_at,
            record.previous_response_id,
            record.status,
            _dumps(record.response),
            _dumps(record.input_items),
            None if record.tool_context is None else _dumps(record.tool_context),
            record.updated_at,
        )
        items = [(item_id, record.id, _dumps(item)) for item_id, item in record_items(record)]

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN")
            try:
                db.execute(
                    f"INSERT INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET created_at = excluded.created_at, "
                    "previous_response_id = excluded.previous_response_id, status = excluded.status, "
                    "response = excluded.response, input_items = excluded.input_items, "
                    "tool_context = excluded.tool_context, updated_at = excluded.updated_at",
                    params,
                )
                db.executemany(
                    "INSERT INTO response_items (item_id, response_id, item) VALUES (?, ?, ?) "
                    "ON CONFLICT (item_id) DO UPDATE SET response_id = excluded.response_id, item = excluded.item",
                    items,
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._run(write)

    async def get(self, response_id: str) -> StoredResponse | None:
        row = await self._run(
            lambda db: db.execute(f"SELECT {_COLUMNS} FROM responses WHERE id = ?", (response_id,)).fetchone()
        )
        return None if row is None else _row_to_record(row)

    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH) -> list[StoredResponse]:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        rows = await self._run(lambda db: db.execute(_CHAIN_SQL, (response_id, max_depth)).fetchall())
        return check_chain(response_id, [_row_to_record(row) for row in rows], max_depth)

    async def get_items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        ids = list(dict.fromkeys(item_ids))[:1000]
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        rows = await self._run(lambda db: db.execute(
            f"SELECT item_id, item FROM response_items WHERE item_id IN ({marks})", ids).fetchall())
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def delete(self, response_id: str) -> bool:
        def run(db: sqlite3.Connection) -> int:
            db.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount

        return await self._run(run) > 0

    async def sweep(self, older_than: int) -> int:
        def run(db: sqlite3.Connection) -> int:
            db.execute("DELETE FROM response_items WHERE response_id IN "
                       "(SELECT id FROM responses WHERE created_at < ?)", (older_than,))
            return db.execute("DELETE FROM responses WHERE created_at < ?", (older_than,)).rowcount

        return await self._run(run)
