"""PostgreSQL ResponseStore: asyncpg pool, JSONB columns, self-migrating schema."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import asyncpg
import orjson

from gateway.store.base import (
    DEFAULT_MAX_CHAIN_DEPTH,
    ResponseStore,
    StoredResponse,
    StoreError,
    check_chain,
    record_items,
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

# MIGRATIONS[n] takes the schema from version n to n + 1; "{s}" is the quoted schema name.
# Append only; never edit a released one.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE IF NOT EXISTS {s}.responses (
            id TEXT PRIMARY KEY,
            created_at BIGINT NOT NULL,
            updated_at BIGINT NOT NULL,
            previous_response_id TEXT,
            status TEXT NOT NULL,
            response JSONB NOT NULL,
            input_items JSONB NOT NULL,
            tool_context JSONB
        )""",
        "CREATE INDEX IF NOT EXISTS responses_created_at ON {s}.responses (created_at)",
        "CREATE INDEX IF NOT EXISTS responses_previous ON {s}.responses (previous_response_id)",
    ),
    (
        # Items by id, for item_reference inputs; rows go with their response (delete, sweep).
        """CREATE TABLE IF NOT EXISTS {s}.response_items (
            item_id TEXT PRIMARY KEY,
            response_id TEXT NOT NULL,
            item JSONB NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS response_items_response ON {s}.response_items (response_id)",
        """INSERT INTO {s}.response_items (item_id, response_id, item)
           SELECT e->>'id', r.id, e FROM {s}.responses r, jsonb_array_elements(r.input_items) e
           WHERE jsonb_typeof(e) = 'object' AND e ? 'id' ON CONFLICT DO NOTHING""",
        """INSERT INTO {s}.response_items (item_id, response_id, item)
           SELECT e->>'id', r.id, e FROM {s}.responses r, jsonb_array_elements(r.response->'output') e
           WHERE jsonb_typeof(r.response->'output') = 'array' AND jsonb_typeof(e) = 'object' AND e ? 'id'
           ON CONFLICT DO NOTHING""",
    ),
]

_COLUMNS = "id, created_at, previous_response_id, status, response, input_items, tool_context, updated_at"


def _lock_key(schema: str) -> int:
    # A stable signed 64-bit key per schema, so gateways using different schemas never wait on each other.
    digest = hashlib.sha256(f"responses-gateway:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# A JSON ``\u0000`` escape (not one preceded by an escaped backslash, which is literal text).
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _encode_jsonb(value: object) -> str:
    # JSONB cannot hold U+0000; store it as U+FFFD rather than fail the write of a whole response.
    text = orjson.dumps(value).decode()
    return _NUL_ESCAPE.sub(r"\1\\ufffd", text) if "\\u0000" in text else text


async def _init_connection(conn: asyncpg.Connection) -> None:
    # orjson both ways: dicts go in and come out without the stdlib json module's cost.
    await conn.set_type_codec(
        "jsonb",
        encoder=_encode_jsonb,
        decoder=orjson.loads,
        schema="pg_catalog",
        format="text",
    )


def _row_to_record(row: asyncpg.Record) -> StoredResponse:
    return StoredResponse(
        id=row["id"],
        created_at=row["created_at"],
        previous_response_id=row["previous_response_id"],
        status=row["status"],
        response=row["response"],
        input_items=row["input_items"],
        tool_context=row["tool_context"],
        updated_at=row["updated_at"],
    )


class PostgresResponseStore(ResponseStore):
    """A store shared by any number of gateway replicas. Tables live in `schema` (created if missing)."""

    def __init__(self, dsn: str, schema: str = "public", min_size: int = 1, max_size: int = 10) -> None:
        if not _IDENTIFIER.fullmatch(schema):
            raise ValueError(f"invalid PostgreSQL schema name {schema!r}")
        self.dsn = dsn
        self.schema = schema
        self._min_size = min_size
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        t = f'"{schema}".responses'
        self._put_sql = (
            f"INSERT INTO {t} ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
            "ON CONFLICT (id) DO UPDATE SET created_at = EXCLUDED.created_at, "
            "previous_response_id = EXCLUDED.previous_response_id, status = EXCLUDED.status, "
            "response = EXCLUDED.response, input_items = EXCLUDED.input_items, "
            "tool_context = EXCLUDED.tool_context, updated_at = EXCLUDED.updated_at"
        )
        self._get_sql = f"SELECT {_COLUMNS} FROM {t} WHERE id = $1"
        self._chain_sql = f"""
            WITH RECURSIVE chain AS (
                SELECT 0 AS depth, {_COLUMNS} FROM {t} WHERE id = $1
                UNION ALL
                SELECT c.depth + 1, r.id, r.created_at, r.previous_response_id, r.status, r.response,
                       r.input_items, r.tool_context, r.updated_at
                FROM {t} r JOIN chain c ON r.id = c.previous_response_id
                WHERE c.depth + 1 < $2
            )
            SELECT {_COLUMNS} FROM chain ORDER BY depth
        """
        self._delete_sql = f"DELETE FROM {t} WHERE id = $1"
        self._sweep_sql = f"DELETE FROM {t} WHERE created_at < $1"
        it = f'"{schema}".response_items'
        self._put_item_sql = (f"INSERT INTO {it} (item_id, response_id, item) VALUES ($1, $2, $3) "
                              "ON CONFLICT (item_id) DO UPDATE SET response_id = EXCLUDED.response_id, "
                              "item = EXCLUDED.item")
        self._get_items_sql = f"SELECT item_id, item FROM {it} WHERE item_id = ANY($1::text[])"
        self._delete_items_sql = f"DELETE FROM {it} WHERE response_id = $1"
        self._sweep_items_sql = f"DELETE FROM {it} WHERE response_id IN (SELECT id FROM {t} WHERE created_at < $1)"

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StoreError("PostgresResponseStore used before start() or after close()")
        return self._pool

    async def start(self) -> None:
        if self._pool is not None:
            return
        pool = await asyncpg.create_pool(
            self.dsn, min_size=self._min_size, max_size=self._max_size, init=_init_connection
        )
        try:
            async with pool.acquire() as conn:
                await self._migrate(conn)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def _migrate(self, conn: asyncpg.Connection) -> None:
        s = f'"{self.schema}"'
        async with conn.transaction():
            # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog's unique indexes;
            # the transaction-scoped advisory lock makes starting replicas migrate one at a time.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _lock_key(self.schema))
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {s}.schema_version ("
                "id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)"
            )
            version = await conn.fetchval(f"SELECT version FROM {s}.schema_version WHERE id = 1") or 0
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"database schema version {version} is newer than this gateway knows "
                    f"({len(MIGRATIONS)}); upgrade the gateway"
                )
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    await conn.execute(statement.format(s=s))
            await conn.execute(
                f"INSERT INTO {s}.schema_version (id, version) VALUES (1, $1) "
                "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version",
                len(MIGRATIONS),
            )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def put(self, record: StoredResponse) -> None:
        items = [(item_id, record.id, item) for item_id, item in record_items(record)]
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                self._put_sql,
                record.id,
                record.created_at,
                record.previous_response_id,
                record.status,
                record.response,
                record.input_items,
                record.tool_context,
                record.updated_at,
            )
            if items:
                await conn.executemany(self._put_item_sql, items)

    async def get(self, response_id: str) -> StoredResponse | None:
        row = await self.pool.fetchrow(self._get_sql, response_id)
        return None if row is None else _row_to_record(row)

    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH) -> list[StoredResponse]:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        rows = await self.pool.fetch(self._chain_sql, response_id, max_depth)
        return check_chain(response_id, [_row_to_record(row) for row in rows], max_depth)

    async def get_items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        ids = list(dict.fromkeys(item_ids))[:1000]
        if not ids:
            return {}
        rows = await self.pool.fetch(self._get_items_sql, ids)
        return {row["item_id"]: row["item"] for row in rows}

    async def delete(self, response_id: str) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._delete_items_sql, response_id)
            return _count(await conn.execute(self._delete_sql, response_id)) > 0

    async def sweep(self, older_than: int) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._sweep_items_sql, older_than)
            return _count(await conn.execute(self._sweep_sql, older_than))


def _count(status: str) -> int:
    # asyncpg returns the command tag, e.g. "DELETE 3".
    return int(status.rsplit(" ", 1)[-1])
