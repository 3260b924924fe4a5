"""SQLite ResponseStore: stdlib sqlite3 in worker threads, one connection behind a lock.

Every multi-statement write is one ``BEGIN IMMEDIATE`` transaction: within a process the lock serializes
calls, across processes sharing the file the write lock does, so concurrent appends to one conversation
never read the same next position. Commits are durable (``synchronous=FULL``) unless the operator chose
``--sqlite-synchronous normal``. The database file and its -wal/-shm are 0600, the folders created for it 0700.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.store.base import (
    DEFAULT_MAX_CHAIN_DEPTH,
    ConversationTurn,
    CursorNotFoundError,
    HistoryTooLargeError,
    ResponseStore,
    StoredConversation,
    StoredResponse,
    StoreError,
    chain_sizes,
    check_item_budget,
    record_items,
)
from gateway.translate.usage import public_response

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
    (
        # Ownership (keyed hash of the gateway API key; NULL without gateway keys) and Conversations.
        "ALTER TABLE responses ADD COLUMN owner TEXT",
        "ALTER TABLE response_items ADD COLUMN owner TEXT",
        """CREATE TABLE IF NOT EXISTS conversations (
            id TEXT PRIMARY KEY,
            owner TEXT,
            created_at INTEGER NOT NULL,
            updated_at INTEGER NOT NULL,
            metadata TEXT NOT NULL,
            next_position INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS conversations_updated_at ON conversations (updated_at)",
        # Items in order of position (reserved from conversations.next_position under the write lock);
        # one id per conversation: an item resent with its id is the same item.
        """CREATE TABLE IF NOT EXISTS conversation_items (
            conversation_id TEXT NOT NULL,
            item_id TEXT NOT NULL,
            position INTEGER NOT NULL,
            item TEXT NOT NULL,
            PRIMARY KEY (conversation_id, item_id)
        )""",
        "CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_position "
        "ON conversation_items (conversation_id, position)",
        "CREATE INDEX IF NOT EXISTS conversation_items_item ON conversation_items (item_id)",
    ),
    (
        # Background responses (gateway.engine.background): the lease of the replica running one (unix ms),
        # a cancel flag, and its stream events by sequence number (they go with their response).
        "ALTER TABLE responses ADD COLUMN background BOOLEAN NOT NULL DEFAULT 0",
        "ALTER TABLE responses ADD COLUMN lease_owner TEXT",
        "ALTER TABLE responses ADD COLUMN lease_expires_at INTEGER",
        "ALTER TABLE responses ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT 0",
        "CREATE INDEX IF NOT EXISTS responses_running ON responses (lease_expires_at) "
        "WHERE status IN ('queued', 'in_progress')",
        """CREATE TABLE IF NOT EXISTS response_events (
            response_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            event TEXT NOT NULL,
            PRIMARY KEY (response_id, sequence_number)
        ) WITHOUT ROWID""",
    ),
    (
        # Item ids are scoped to their owner ('' without gateway keys): one tenant's msg_x no longer blocks
        # another's. The items other owners lost to the old global uniqueness come back from their responses
        # (the latest response's copy first; the rows already kept win).
        """CREATE TABLE response_items_by_owner (
            owner TEXT NOT NULL DEFAULT '',
            item_id TEXT NOT NULL,
            response_id TEXT NOT NULL,
            item TEXT NOT NULL,
            PRIMARY KEY (owner, item_id)
        )""",
        """INSERT INTO response_items_by_owner (owner, item_id, response_id, item)
           SELECT coalesce(owner, ''), item_id, response_id, item FROM response_items""",
        """INSERT OR IGNORE INTO response_items_by_owner (owner, item_id, response_id, item)
           SELECT coalesce(r.owner, ''), json_extract(j.value, '$.id'), r.id, j.value
           FROM responses r, json_each(r.input_items) j
           WHERE j.type = 'object' AND json_extract(j.value, '$.id') IS NOT NULL ORDER BY r.created_at DESC""",
        """INSERT OR IGNORE INTO response_items_by_owner (owner, item_id, response_id, item)
           SELECT coalesce(r.owner, ''), json_extract(j.value, '$.id'), r.id, j.value
           FROM responses r, json_each(r.response, '$.output') j
           WHERE j.type = 'object' AND json_extract(j.value, '$.id') IS NOT NULL ORDER BY r.created_at DESC""",
        "DROP TABLE response_items",
        "ALTER TABLE response_items_by_owner RENAME TO response_items",
        "CREATE INDEX IF NOT EXISTS response_items_response ON response_items (response_id)",
    ),
]

# The history bound's "unbounded".
_NO_BOUND = 2**62
# Bytes (not characters) of a stored JSON text.
_BYTES = "length(CAST({} AS BLOB))"
_RECORD_BYTES = (f"{_BYTES.format('{p}response')} + {_BYTES.format('{p}input_items')}")

# "(? IS NULL OR owner = ?)", bound to (owner, owner): no owner given means single-tenant, no filter.
_OWNED = "(? IS NULL OR owner = ?)"
_CONV_COLUMNS = "id, created_at, updated_at, metadata, owner"
_MAX_POSITION = 2**62

_COLUMNS = "id, created_at, previous_response_id, status, response, input_items, tool_context, updated_at, owner"
_RUNNING = "status IN ('queued', 'in_progress')"

# The chain's ids with a running total of their stored bytes, newest first; the recursion stops at the depth
# bound and once the total has passed the byte bound, so no more than one record past it is ever measured.
_CHAIN_SQL = f"""
WITH RECURSIVE chain(depth, id, previous_response_id, total) AS (
    SELECT 0, id, previous_response_id, {_RECORD_BYTES.format(p="")} FROM responses WHERE id = ? AND {_OWNED}
    UNION ALL
    SELECT c.depth + 1, r.id, r.previous_response_id, c.total + {_RECORD_BYTES.format(p="r.")}
    FROM responses r JOIN chain c ON r.id = c.previous_response_id
    WHERE c.depth + 1 < ? AND c.total <= ? AND (? IS NULL OR r.owner = ?)
)
SELECT id, previous_response_id, total FROM chain ORDER BY depth
"""

_PUT_SQL = (
    f"INSERT INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET created_at = excluded.created_at, "
    "previous_response_id = excluded.previous_response_id, status = excluded.status, "
    "response = excluded.response, input_items = excluded.input_items, "
    "tool_context = excluded.tool_context, updated_at = excluded.updated_at, owner = excluded.owner "
    # A background response's final status is final: a late write of its run is dropped.
    "WHERE NOT responses.background OR responses.status IN ('queued', 'in_progress')"
)
# Item ids are unique per owner ('' without one): a later write of the same owner's id replaces it.
_PUT_ITEM_SQL = ("INSERT INTO response_items (item_id, response_id, item, owner) VALUES (?, ?, ?, ?) "
                 "ON CONFLICT (owner, item_id) DO UPDATE SET response_id = excluded.response_id, item = excluded.item")


def _dumps(value: Any) -> str:
    # TEXT rather than BLOB so the file stays inspectable with the sqlite3 shell and json_extract().
    return orjson.dumps(value).decode()


def _ms(seconds: float) -> int:
    """Lease times are stored as unix milliseconds."""
    return int(seconds * 1000)


def _row_to_record(row: tuple[Any, ...]) -> StoredResponse:
    return StoredResponse(
        id=row[0],
        created_at=row[1],
        previous_response_id=row[2],
        status=row[3],
        response=public_response(orjson.loads(row[4])),  # older rows: usage in today's shape
        input_items=orjson.loads(row[5]),
        tool_context=None if row[6] is None else orjson.loads(row[6]),
        updated_at=row[7],
        owner=row[8],
    )


def _row_to_conversation(row: tuple[Any, ...]) -> StoredConversation:
    return StoredConversation(id=row[0], created_at=row[1], updated_at=row[2], metadata=orjson.loads(row[3]),
                              owner=row[4])


def _transaction(db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], begin: str = "BEGIN IMMEDIATE") -> T:
    db.execute(begin)
    try:
        out = fn(db)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return out


def _record_params(record: StoredResponse) -> tuple[Any, ...]:
    return (record.id, record.created_at, record.previous_response_id, record.status, _dumps(record.response),
            _dumps(record.input_items), None if record.tool_context is None else _dumps(record.tool_context),
            record.updated_at, record.owner)


def _item_rows(record: StoredResponse) -> list[tuple[str, str, str, str]]:
    return [(item_id, record.id, _dumps(item), record.owner or "") for item_id, item in record_items(record)]


def _append_items(db: sqlite3.Connection, conversation_id: str, items: list[dict[str, Any]], updated_at: int,
                  owner: str | None) -> bool:
    # The UPDATE takes the write lock and reserves len(items) positions in one statement.
    row = db.execute(
        "UPDATE conversations SET next_position = next_position + ?, updated_at = max(updated_at, ?) "
        f"WHERE id = ? AND {_OWNED} RETURNING next_position",
        (len(items), updated_at, conversation_id, owner, owner)).fetchone()
    if row is None:
        return False
    _insert_items(db, conversation_id, int(row[0]) - len(items), items)
    return True


def _create_private(path: Path) -> None:
    """The database file (and the folders the gateway creates for it) readable by this user only: 0600 / 0700,
    whatever the umask; an existing file is tightened."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(folder, 0o700)
        os.chmod(folder, 0o700)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # made 0600 whatever the umask; sqlite3 opens it after
    _private(path)
    _tighten_sidecars(path)


def _tighten_sidecars(path: Path) -> None:
    # SQLite gives -wal/-shm the database file's mode when it creates them; files left by an older gateway
    # (or created before the database was tightened) are tightened here.
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            _private(Path(f"{path}{suffix}"))


def _private(path: Path) -> None:
    # A file another user owns (shared through its group) cannot be tightened by this one: said, not fatal.
    try:
        os.chmod(path, 0o600)
    except PermissionError:
        logging.getLogger(__name__).warning("could not make %s private (0600): not its owner", path)


def _key_file(path: Path) -> bytes:
    """The 32-byte key in ``path`` (base64, one line), made first if missing. Processes starting at once agree:
    each writes a private temporary file and links it into place; the first link wins, the others read it."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{base64.b16encode(os.urandom(4)).decode()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, base64.b64encode(os.urandom(32)) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        with contextlib.suppress(OSError):  # the link survives a crash (not possible everywhere: best effort)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    if path.stat().st_mode & 0o077:
        _private(path)
    try:
        key = base64.b64decode(path.read_bytes().strip(), validate=True)
    except ValueError as exc:
        raise StoreError(f"{path} does not hold a base64 key") from exc
    if len(key) != 32:
        raise StoreError(f"{path} does not hold a 32-byte key")
    return key


def _insert_items(db: sqlite3.Connection, conversation_id: str, start: int, items: list[dict[str, Any]]) -> None:
    db.executemany(
        "INSERT INTO conversation_items (conversation_id, item_id, position, item) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (conversation_id, item_id) DO NOTHING",
        [(conversation_id, item["id"], start + n, _dumps(item)) for n, item in enumerate(items)],
    )


def _enable_wal(db: sqlite3.Connection, timeout: float) -> None:
    """``PRAGMA journal_mode = WAL``, retried while another process holds the file: switching the journal mode
    needs an exclusive lock and SQLite answers "database is locked" at once there instead of calling the busy
    handler (two workers of ``--workers N`` opening a new database at the same moment)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class SqliteResponseStore(ResponseStore):
    """A single-file store for one host. Several processes may share the file (WAL + busy_timeout)."""

    def __init__(self, path: str | Path, busy_timeout_ms: int = 5000, synchronous: str = "full") -> None:
        if synchronous not in ("full", "normal"):
            raise ValueError(f"sqlite synchronous must be 'full' or 'normal', not {synchronous!r}")
        self.path = Path(path)
        self._busy_timeout_ms = busy_timeout_ms
        self.synchronous = synchronous
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
            _create_private(self.path)
            # isolation_level=None: autocommit, so each write statement is its own committed
            # transaction and multi-statement ones are explicit below.
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                _enable_wal(db, self._busy_timeout_ms / 1000)
                # FULL (the default): a commit is on disk when it returns, as put() promises. NORMAL in WAL mode
                # survives a killed process but may lose the last commits on a power cut (--sqlite-synchronous).
                db.execute(f"PRAGMA synchronous = {self.synchronous.upper()}")
                self._migrate(db)
                _tighten_sidecars(self.path)
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

    @property
    def key_path(self) -> Path:
        """Where the gateway's own key is kept: a 0600 file beside the database."""
        return Path(f"{self.path}.key")

    async def key_material(self) -> bytes:
        return await asyncio.to_thread(_key_file, self.key_path)

    async def close(self) -> None:
        def close_sync() -> None:
            with self._lock:
                self._closed = True
                if self._db is not None:
                    self._db.close()
                    self._db = None

        await asyncio.to_thread(close_sync)

    async def put(self, record: StoredResponse | None, turn: ConversationTurn | None = None,
                  owner: str | None = None) -> bool:
        params = None if record is None else _record_params(record)
        items = [] if record is None else _item_rows(record)

        def run(db: sqlite3.Connection) -> bool:
            if params is not None:
                db.execute(_PUT_SQL, params)
                db.executemany(_PUT_ITEM_SQL, items)
            if turn is None:
                return True
            return _append_items(db, turn.conversation_id, turn.items, turn.updated_at, owner)

        return await self._run(lambda db: _transaction(db, run))

    async def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        row = await self._run(lambda db: db.execute(
            f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND {_OWNED}", (response_id, owner, owner)).fetchone())
        return None if row is None else _row_to_record(row)

    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH,
                        owner: str | None = None, max_bytes: int | None = None) -> list[StoredResponse]:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        bound = _NO_BOUND if max_bytes is None else max_bytes

        def run(db: sqlite3.Connection) -> list[StoredResponse]:
            sizes = db.execute(_CHAIN_SQL, (response_id, owner, owner, max_depth, bound, owner, owner)).fetchall()
            ids = chain_sizes(response_id, sizes, max_depth, max_bytes)
            if not ids:
                return []
            marks = ", ".join("?" * len(ids))
            # Row by row: each record's JSON text is dropped once parsed.
            found = {rec.id: rec for rec in map(_row_to_record, db.execute(
                f"SELECT {_COLUMNS} FROM responses WHERE id IN ({marks})", ids))}
            missing = [i for i in ids if i not in found]
            if missing:  # cannot happen inside the read transaction; kept as the chain's own error
                raise StoreError(f"response {missing[0]!r} vanished while its chain was read")
            return [found[i] for i in ids]

        return await self._run(lambda db: _transaction(db, run, "BEGIN"))

    async def get_items(self, item_ids: list[str], owner: str | None = None,
                        max_bytes: int | None = None) -> dict[str, dict[str, Any]]:
        ids = list(dict.fromkeys(item_ids))[:1000]
        if not ids:
            return {}

        def run(db: sqlite3.Connection) -> dict[str, dict[str, Any]]:
            marks = ", ".join("?" * len(ids))
            # Sizes and row ids first; the items themselves only once their total is known to fit.
            where: dict[str, tuple[str, int, int]] = {}
            for item_id, rowid, size in db.execute(
                    f"SELECT item_id, rowid, {_BYTES.format('item')} FROM response_items "
                    f"WHERE item_id IN ({marks}) AND {_OWNED} ORDER BY rowid", (*ids, owner, owner)):
                where[item_id] = ("response_items", rowid, size)
            rest = [i for i in ids if i not in where]
            if rest:
                marks = ", ".join("?" * len(rest))
                for item_id, rowid, size in db.execute(  # the latest conversation's copy wins
                        f"SELECT ci.item_id, ci.rowid, {_BYTES.format('ci.item')} FROM conversation_items ci "
                        f"JOIN conversations c ON c.id = ci.conversation_id WHERE ci.item_id IN ({marks}) "
                        "AND (? IS NULL OR c.owner = ?) ORDER BY c.updated_at, ci.position", (*rest, owner, owner)):
                    where[item_id] = ("conversation_items", rowid, size)
            check_item_budget(ids, {item_id: w[2] for item_id, w in where.items()}, max_bytes)
            found: dict[str, dict[str, Any]] = {}
            for table in ("response_items", "conversation_items"):
                rowids = {w[1]: item_id for item_id, w in where.items() if w[0] == table}
                if rowids:
                    marks = ", ".join("?" * len(rowids))
                    for rowid, item in db.execute(f"SELECT rowid, item FROM {table} WHERE rowid IN ({marks})",
                                                  list(rowids)):
                        found[rowids[rowid]] = orjson.loads(item)
            return found

        return await self._run(lambda db: _transaction(db, run, "BEGIN"))

    async def delete(self, response_id: str, owner: str | None = None) -> bool:
        def run(db: sqlite3.Connection) -> int:
            deleted = db.execute(f"DELETE FROM responses WHERE id = ? AND {_OWNED}",
                                 (response_id, owner, owner)).rowcount
            if deleted:
                db.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))
                db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
            return deleted

        return await self._run(lambda db: _transaction(db, run)) > 0

    async def sweep(self, older_than: int) -> int:
        def run(db: sqlite3.Connection) -> int:
            db.execute("DELETE FROM response_items WHERE response_id IN "
                       "(SELECT id FROM responses WHERE created_at < ?)", (older_than,))
            db.execute("DELETE FROM response_events WHERE response_id IN "
                       "(SELECT id FROM responses WHERE created_at < ?)", (older_than,))
            deleted = db.execute("DELETE FROM responses WHERE created_at < ?", (older_than,)).rowcount
            db.execute("DELETE FROM conversation_items WHERE conversation_id IN "
                       "(SELECT id FROM conversations WHERE updated_at < ?)", (older_than,))
            return deleted + db.execute("DELETE FROM conversations WHERE updated_at < ?", (older_than,)).rowcount

        return await self._run(lambda db: _transaction(db, run))

    # ------------------------------------------------------------------ background responses
    # Other processes sharing the file get no notification: their followers and heartbeats poll.

    async def create_background(self, record: StoredResponse, lease_owner: str, lease_expires_at: float) -> None:
        params = (*_record_params(record), lease_owner, _ms(lease_expires_at))
        items = _item_rows(record)

        def run(db: sqlite3.Connection) -> None:
            db.execute(f"INSERT INTO responses ({_COLUMNS}, background, lease_owner, lease_expires_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?)", params)
            db.executemany(_PUT_ITEM_SQL, items)

        await self._run(lambda db: _transaction(db, run))

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        rows = [(response_id, int(e["sequence_number"]), _dumps(e)) for e in events]
        await self._run(lambda db: _transaction(db, lambda db: db.executemany(
            "INSERT INTO response_events (response_id, sequence_number, event) VALUES (?, ?, ?) "
            "ON CONFLICT (response_id, sequence_number) DO NOTHING", rows)))
        self._notify_local(response_id, str(rows[-1][1]))

    async def get_events(self, response_id: str, after: int = -1, owner: str | None = None,
                         limit: int = 1000) -> list[dict[str, Any]]:
        rows = await self._run(lambda db: db.execute(
            "SELECT e.event FROM response_events e WHERE e.response_id = ? AND e.sequence_number > ? AND EXISTS "
            "(SELECT 1 FROM responses r WHERE r.id = e.response_id AND (? IS NULL OR r.owner = ?)) "
            "ORDER BY e.sequence_number LIMIT ?", (response_id, after, owner, owner, limit)).fetchall())
        return [orjson.loads(row[0]) for row in rows]

    async def set_status(self, response_id: str, status: str, response: dict[str, Any], *,
                         event: dict[str, Any] | None = None, lease_owner: str | None = None,
                         expired_before: float | None = None) -> bool:
        where = f"id = ? AND background AND {_RUNNING}"
        params: list[Any] = [status, _dumps(response), int(time.time()), response_id]
        # A lease given up on is nobody's: a replica that was only stalled stops its run at its next renewal.
        clear = ", lease_owner = NULL" if expired_before is not None else ""
        if lease_owner is not None:
            where += " AND lease_owner = ?"
            params.append(lease_owner)
        if expired_before is not None:
            where += " AND lease_expires_at < ?"
            params.append(_ms(expired_before))

        def run(db: sqlite3.Connection) -> int | None:
            if not db.execute(f"UPDATE responses SET status = ?, response = ?, updated_at = ?{clear} WHERE {where}",
                              params).rowcount:
                return None
            if event is None:
                return -1
            seq = db.execute("SELECT COALESCE(MAX(sequence_number), -1) + 1 FROM response_events "
                             "WHERE response_id = ?", (response_id,)).fetchone()[0]
            event["sequence_number"] = int(seq)
            db.execute("INSERT INTO response_events (response_id, sequence_number, event) VALUES (?, ?, ?)",
                       (response_id, int(seq), _dumps(event)))
            return int(seq)

        seq = await self._run(lambda db: _transaction(db, run))
        if seq is not None and seq >= 0:
            self._notify_local(response_id, str(seq))
        return seq is not None

    async def renew_leases(self, lease_owner: str, response_ids: list[str], lease_expires_at: float) -> list[str]:
        ids = list(dict.fromkeys(response_ids))
        if not ids:
            return []
        marks = ", ".join("?" * len(ids))

        def run(db: sqlite3.Connection) -> list[str]:
            db.execute(f"UPDATE responses SET lease_expires_at = ? WHERE id IN ({marks}) AND lease_owner = ? "
                       f"AND {_RUNNING}", (_ms(lease_expires_at), *ids, lease_owner))
            found = {row[0]: (row[1], bool(row[2])) for row in db.execute(
                f"SELECT id, lease_owner, cancel_requested FROM responses WHERE id IN ({marks})", ids)}
            return [i for i in ids if i not in found or found[i][1] or found[i][0] != lease_owner]

        return await self._run(lambda db: _transaction(db, run))

    async def request_cancel(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        def run(db: sqlite3.Connection) -> tuple[tuple[Any, ...] | None, bool]:
            row = db.execute(
                "UPDATE responses SET status = 'cancelled', cancel_requested = 1, updated_at = ?, "
                "response = json_set(response, '$.status', 'cancelled') "
                f"WHERE id = ? AND {_OWNED} AND background AND {_RUNNING} RETURNING {_COLUMNS}",
                (int(time.time()), response_id, owner, owner)).fetchone()
            if row is not None:
                return row, True
            return db.execute(f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND {_OWNED}",
                              (response_id, owner, owner)).fetchone(), False

        row, changed = await self._run(lambda db: _transaction(db, run))
        if changed:
            self._notify_local(response_id, "cancel")
        return None if row is None else _row_to_record(row)

    async def expired_leases(self, now: float, limit: int = 100) -> list[str]:
        rows = await self._run(lambda db: db.execute(
            f"SELECT id FROM responses WHERE {_RUNNING} AND background AND lease_expires_at < ? LIMIT ?",
            (_ms(now), limit)).fetchall())
        return [row[0] for row in rows]

    # ------------------------------------------------------------------ conversations

    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        c = conversation

        def run(db: sqlite3.Connection) -> None:
            db.execute(f"INSERT INTO conversations ({_CONV_COLUMNS}, next_position) VALUES (?, ?, ?, ?, ?, ?)",
                       (c.id, c.created_at, c.updated_at, _dumps(c.metadata), c.owner, len(items)))
            _insert_items(db, c.id, 0, items)

        await self._run(lambda db: _transaction(db, run))

    async def get_conversation(self, conversation_id: str, owner: str | None = None) -> StoredConversation | None:
        row = await self._run(lambda db: db.execute(
            f"SELECT {_CONV_COLUMNS} FROM conversations WHERE id = ? AND {_OWNED}",
            (conversation_id, owner, owner)).fetchone())
        return None if row is None else _row_to_conversation(row)

    async def update_conversation(self, conversation_id: str, metadata: dict[str, Any], updated_at: int,
                                  owner: str | None = None) -> StoredConversation | None:
        row = await self._run(lambda db: db.execute(
            f"UPDATE conversations SET metadata = ?, updated_at = ? WHERE id = ? AND {_OWNED} "
            f"RETURNING {_CONV_COLUMNS}", (_dumps(metadata), updated_at, conversation_id, owner, owner)).fetchone())
        return None if row is None else _row_to_conversation(row)

    async def delete_conversation(self, conversation_id: str, owner: str | None = None) -> bool:
        def run(db: sqlite3.Connection) -> int:
            deleted = db.execute(f"DELETE FROM conversations WHERE id = ? AND {_OWNED}",
                                 (conversation_id, owner, owner)).rowcount
            if deleted:
                db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            return deleted

        return await self._run(lambda db: _transaction(db, run)) > 0

    async def append_conversation_items(self, conversation_id: str, items: list[dict[str, Any]], updated_at: int,
                                        owner: str | None = None) -> bool:
        return await self._run(lambda db: _transaction(
            db, lambda db: _append_items(db, conversation_id, items, updated_at, owner)))

    async def get_conversation_items(self, conversation_id: str, owner: str | None = None,
                                     max_bytes: int | None = None) -> list[dict[str, Any]] | None:
        def run(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            if db.execute(f"SELECT 1 FROM conversations WHERE id = ? AND {_OWNED}",
                          (conversation_id, owner, owner)).fetchone() is None:
                return None
            if max_bytes is not None:  # measured in the database before any item is loaded
                total = db.execute(f"SELECT coalesce(sum({_BYTES.format('item')}), 0) FROM conversation_items "
                                   "WHERE conversation_id = ?", (conversation_id,)).fetchone()[0]
                if total > max_bytes:
                    raise HistoryTooLargeError(max_bytes)
            return [orjson.loads(row[0]) for row in db.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY position",
                (conversation_id,))]

        return await self._run(lambda db: _transaction(db, run, "BEGIN"))

    async def list_conversation_items(self, conversation_id: str, *, limit: int, order: str = "desc",
                                      after: str | None = None, owner: str | None = None
                                      ) -> tuple[list[dict[str, Any]], bool] | None:
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")

        def run(db: sqlite3.Connection) -> tuple[list[dict[str, Any]], bool] | None:
            if db.execute(f"SELECT 1 FROM conversations WHERE id = ? AND {_OWNED}",
                          (conversation_id, owner, owner)).fetchone() is None:
                return None
            bound = -1 if order == "asc" else _MAX_POSITION
            if after is not None:
                row = db.execute("SELECT position FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                                 (conversation_id, after)).fetchone()
                if row is None:
                    raise CursorNotFoundError(after)
                bound = int(row[0])
            op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
            rows = db.execute(
                f"SELECT item FROM conversation_items WHERE conversation_id = ? AND position {op} ? "
                f"ORDER BY position {direction} LIMIT ?", (conversation_id, bound, limit + 1)).fetchall()
            return [orjson.loads(r[0]) for r in rows[:limit]], len(rows) > limit

        return await self._run(lambda db: _transaction(db, run, "BEGIN"))

    async def get_conversation_item(self, conversation_id: str, item_id: str, owner: str | None = None
                                    ) -> dict[str, Any] | None:
        row = await self._run(lambda db: db.execute(
            "SELECT ci.item FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id "
            "WHERE ci.conversation_id = ? AND ci.item_id = ? AND (? IS NULL OR c.owner = ?)",
            (conversation_id, item_id, owner, owner)).fetchone())
        return None if row is None else orjson.loads(row[0])

    async def delete_conversation_item(self, conversation_id: str, item_id: str, updated_at: int,
                                       owner: str | None = None) -> bool:
        def run(db: sqlite3.Connection) -> bool:
            if db.execute(f"SELECT 1 FROM conversations WHERE id = ? AND {_OWNED}",
                          (conversation_id, owner, owner)).fetchone() is None:
                return False
            if not db.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                              (conversation_id, item_id)).rowcount:
                return False
            db.execute("UPDATE conversations SET updated_at = max(updated_at, ?) WHERE id = ?",
                       (updated_at, conversation_id))
            return True

        return await self._run(lambda db: _transaction(db, run))
