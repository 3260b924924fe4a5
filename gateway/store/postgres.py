"""PostgreSQL ResponseStore: asyncpg pool, JSONB columns, self-migrating schema.

Appends to a conversation reserve their positions with one ``UPDATE … RETURNING next_position`` on the
conversation's row: the row lock serializes concurrent appends (from any replica) until each commits, so
none is lost and each batch stays contiguous in commit order. Deletes take that row first for the same reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any, TypeAlias

import asyncpg
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

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# a connection as the pool hands it out (a proxy) or as connect() makes it
_Conn: TypeAlias = "asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]"

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
    (
        # Ownership (keyed hash of the gateway API key; NULL without gateway keys) and Conversations.
        "ALTER TABLE {s}.responses ADD COLUMN IF NOT EXISTS owner TEXT",
        "ALTER TABLE {s}.response_items ADD COLUMN IF NOT EXISTS owner TEXT",
        """CREATE TABLE IF NOT EXISTS {s}.conversations (
            id TEXT PRIMARY KEY,
            owner TEXT,
            created_at BIGINT NOT NULL,
            updated_at BIGINT NOT NULL,
            metadata JSONB NOT NULL,
            next_position BIGINT NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS conversations_updated_at ON {s}.conversations (updated_at)",
        """CREATE TABLE IF NOT EXISTS {s}.conversation_items (
            conversation_id TEXT NOT NULL,
            item_id TEXT NOT NULL,
            position BIGINT NOT NULL,
            item JSONB NOT NULL,
            PRIMARY KEY (conversation_id, item_id)
        )""",
        "CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_position "
        "ON {s}.conversation_items (conversation_id, position)",
        "CREATE INDEX IF NOT EXISTS conversation_items_item ON {s}.conversation_items (item_id)",
    ),
    (
        # Background responses (gateway.engine.background): the lease of the replica running one (unix ms),
        # a cancel flag, and its stream events by sequence number (they go with their response).
        "ALTER TABLE {s}.responses ADD COLUMN IF NOT EXISTS background BOOLEAN NOT NULL DEFAULT FALSE",
        "ALTER TABLE {s}.responses ADD COLUMN IF NOT EXISTS lease_owner TEXT",
        "ALTER TABLE {s}.responses ADD COLUMN IF NOT EXISTS lease_expires_at BIGINT",
        "ALTER TABLE {s}.responses ADD COLUMN IF NOT EXISTS cancel_requested BOOLEAN NOT NULL DEFAULT FALSE",
        "CREATE INDEX IF NOT EXISTS responses_running ON {s}.responses (lease_expires_at) "
        "WHERE status IN ('queued', 'in_progress')",
        """CREATE TABLE IF NOT EXISTS {s}.response_events (
            response_id TEXT NOT NULL,
            sequence_number BIGINT NOT NULL,
            event JSONB NOT NULL,
            PRIMARY KEY (response_id, sequence_number)
        )""",
    ),
    (
        # Item ids are scoped to their owner ('' without gateway keys): one tenant's msg_x no longer blocks
        # another's. The items other owners lost to the old global uniqueness come back from their responses
        # (the latest response's copy first; the rows already kept win).
        "UPDATE {s}.response_items SET owner = '' WHERE owner IS NULL",
        "ALTER TABLE {s}.response_items ALTER COLUMN owner SET DEFAULT '', ALTER COLUMN owner SET NOT NULL",
        "ALTER TABLE {s}.response_items DROP CONSTRAINT IF EXISTS response_items_pkey",
        "ALTER TABLE {s}.response_items ADD CONSTRAINT response_items_pkey PRIMARY KEY (owner, item_id)",
        """INSERT INTO {s}.response_items (owner, item_id, response_id, item)
           SELECT coalesce(r.owner, ''), e->>'id', r.id, e FROM {s}.responses r, jsonb_array_elements(r.input_items) e
           WHERE jsonb_typeof(r.input_items) = 'array' AND jsonb_typeof(e) = 'object' AND e ? 'id'
           ORDER BY r.created_at DESC ON CONFLICT DO NOTHING""",
        """INSERT INTO {s}.response_items (owner, item_id, response_id, item)
           SELECT coalesce(r.owner, ''), e->>'id', r.id, e FROM {s}.responses r,
                  jsonb_array_elements(r.response->'output') e
           WHERE jsonb_typeof(r.response->'output') = 'array' AND jsonb_typeof(e) = 'object' AND e ? 'id'
           ORDER BY r.created_at DESC ON CONFLICT DO NOTHING""",
    ),
    (
        # The gateway's own key (reasoning sealing, approval ids) when --reasoning-key is unset: one row, shared
        # by every replica of the store.
        """CREATE TABLE IF NOT EXISTS {s}.gateway_keys (
            name TEXT PRIMARY KEY,
            material BYTEA NOT NULL,
            created_at BIGINT NOT NULL
        )""",
    ),
]

# The history bound's "unbounded".
_NO_BOUND = 2**62

_COLUMNS = "id, created_at, previous_response_id, status, response, input_items, tool_context, updated_at, owner"
_RUNNING = "status IN ('queued', 'in_progress')"
_CONV_COLUMNS = "id, created_at, updated_at, metadata, owner"
_MAX_POSITION = 2**62


def _owned(n: int, column: str = "owner") -> str:
    """The owner filter on parameter $n: no owner given means single-tenant, no filter."""
    return f"(${n}::text IS NULL OR {column} = ${n})"


def _ms(seconds: float) -> int:
    """Lease times are stored as unix milliseconds."""
    return int(seconds * 1000)


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
        response=public_response(row["response"]),  # older rows: usage in today's shape
        input_items=row["input_items"],
        tool_context=row["tool_context"],
        updated_at=row["updated_at"],
        owner=row["owner"],
    )


def _row_to_conversation(row: asyncpg.Record) -> StoredConversation:
    return StoredConversation(id=row["id"], created_at=row["created_at"], updated_at=row["updated_at"],
                              metadata=row["metadata"], owner=row["owner"])


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
            f"INSERT INTO {t} ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) "
            "ON CONFLICT (id) DO UPDATE SET created_at = EXCLUDED.created_at, "
            "previous_response_id = EXCLUDED.previous_response_id, status = EXCLUDED.status, "
            "response = EXCLUDED.response, input_items = EXCLUDED.input_items, "
            "tool_context = EXCLUDED.tool_context, updated_at = EXCLUDED.updated_at, owner = EXCLUDED.owner "
            # A background response's final status is final: a late write of its run is dropped.
            f"WHERE NOT {t}.background OR {t}.status IN ('queued', 'in_progress')"
        )
        self._get_sql = f"SELECT {_COLUMNS} FROM {t} WHERE id = $1 AND {_owned(2)}"
        # The chain's ids with a running total of their JSON's bytes, newest first; the recursion stops at the
        # depth bound and once the total has passed the byte bound (at most one record past it is measured).
        size = "octet_length({p}response::text) + octet_length({p}input_items::text)"
        self._chain_sql = f"""
            WITH RECURSIVE chain AS (
                SELECT 0 AS depth, id, previous_response_id, ({size.format(p="")})::bigint AS total
                FROM {t} WHERE id = $1 AND {_owned(3)}
                UNION ALL
                SELECT c.depth + 1, r.id, r.previous_response_id, c.total + {size.format(p="r.")}
                FROM {t} r JOIN chain c ON r.id = c.previous_response_id
                WHERE c.depth + 1 < $2 AND c.total <= $4 AND {_owned(3, "r.owner")}
            )
            SELECT id, previous_response_id, total FROM chain ORDER BY depth
        """
        self._chain_rows_sql = f"SELECT {_COLUMNS} FROM {t} WHERE id = ANY($1::text[])"
        self._delete_sql = f"DELETE FROM {t} WHERE id = $1 AND {_owned(2)}"
        self._sweep_sql = f"DELETE FROM {t} WHERE created_at < $1"
        it = f'"{schema}".response_items'
        # Item ids are unique per owner ('' without one): a later write of the same owner's id replaces it.
        self._put_item_sql = (f"INSERT INTO {it} (item_id, response_id, item, owner) VALUES ($1, $2, $3, $4) "
                              "ON CONFLICT (owner, item_id) DO UPDATE SET response_id = EXCLUDED.response_id, "
                              "item = EXCLUDED.item")
        # Sizes (and where each item is) first; the items only once their total is known to fit.
        self._item_sizes_sql = (f"SELECT item_id, ctid::text AS at, octet_length(item::text) AS size FROM {it} "
                                f"WHERE item_id = ANY($1::text[]) AND {_owned(2)}")
        self._items_at_sql = f"SELECT ctid::text AS at, item FROM {it} WHERE ctid = ANY($1::text[]::tid[])"
        self._delete_items_sql = f"DELETE FROM {it} WHERE response_id = $1"
        self._sweep_items_sql = f"DELETE FROM {it} WHERE response_id IN (SELECT id FROM {t} WHERE created_at < $1)"
        ev = f'"{schema}".response_events'
        self._delete_events_sql = f"DELETE FROM {ev} WHERE response_id = $1"
        self._sweep_events_sql = f"DELETE FROM {ev} WHERE response_id IN (SELECT id FROM {t} WHERE created_at < $1)"
        self._create_bg_sql = (f"INSERT INTO {t} ({_COLUMNS}, background, lease_owner, lease_expires_at) "
                               "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, TRUE, $10, $11)")
        self._append_event_sql = (f"INSERT INTO {ev} (response_id, sequence_number, event) VALUES ($1, $2, $3) "
                                  "ON CONFLICT (response_id, sequence_number) DO NOTHING")
        self._get_events_sql = (f"SELECT e.event FROM {ev} e WHERE e.response_id = $1 AND e.sequence_number > $2 "
                                f"AND EXISTS (SELECT 1 FROM {t} r WHERE r.id = $1 AND {_owned(3, 'r.owner')}) "
                                "ORDER BY e.sequence_number LIMIT $4")
        self._next_seq_sql = f"SELECT COALESCE(MAX(sequence_number), -1) + 1 FROM {ev} WHERE response_id = $1"
        self._renew_sql = (f"UPDATE {t} SET lease_expires_at = $3 WHERE id = ANY($1::text[]) AND lease_owner = $2 "
                           f"AND {_RUNNING}")
        self._lease_state_sql = f"SELECT id, lease_owner, cancel_requested FROM {t} WHERE id = ANY($1::text[])"
        self._cancel_sql = (f"UPDATE {t} SET status = 'cancelled', cancel_requested = TRUE, updated_at = $3, "
                            "response = jsonb_set(response, '{status}', '\"cancelled\"') "
                            f"WHERE id = $1 AND {_owned(2)} AND background AND {_RUNNING} RETURNING {_COLUMNS}")
        self._expired_sql = (f"SELECT id FROM {t} WHERE {_RUNNING} AND background AND lease_expires_at < $1 "
                             "LIMIT $2")
        # One channel per schema (NOTIFY is database-wide); identifiers are at most 63 bytes.
        self.channel = "responses_gateway_" + hashlib.sha256(schema.encode()).hexdigest()[:16]
        self._listen_conn: asyncpg.Connection | None = None
        c = f'"{schema}".conversations'
        ci = f'"{schema}".conversation_items'
        self._conv_item_sizes_sql = (
            f"SELECT ci.item_id, ci.ctid::text AS at, octet_length(ci.item::text) AS size FROM {ci} ci "
            f"JOIN {c} c ON c.id = ci.conversation_id WHERE ci.item_id = ANY($1::text[]) AND {_owned(2, 'c.owner')} "
            "ORDER BY c.updated_at, ci.position")
        self._conv_items_at_sql = f"SELECT ctid::text AS at, item FROM {ci} WHERE ctid = ANY($1::text[]::tid[])"
        self._conv_bytes_sql = (f"SELECT coalesce(sum(octet_length(item::text)), 0) FROM {ci} "
                                "WHERE conversation_id = $1")
        self._create_conv_sql = (f"INSERT INTO {c} ({_CONV_COLUMNS}, next_position) "
                                 "VALUES ($1, $2, $3, $4, $5, $6)")
        self._insert_conv_item_sql = (f"INSERT INTO {ci} (conversation_id, item_id, position, item) "
                                      "VALUES ($1, $2, $3, $4) ON CONFLICT (conversation_id, item_id) DO NOTHING")
        self._get_conv_sql = f"SELECT {_CONV_COLUMNS} FROM {c} WHERE id = $1 AND {_owned(2)}"
        self._lock_conv_sql = f"SELECT 1 FROM {c} WHERE id = $1 AND {_owned(2)} FOR UPDATE"
        self._update_conv_sql = (f"UPDATE {c} SET metadata = $2, updated_at = $3 WHERE id = $1 AND {_owned(4)} "
                                 f"RETURNING {_CONV_COLUMNS}")
        self._touch_conv_sql = f"UPDATE {c} SET updated_at = GREATEST(updated_at, $2) WHERE id = $1"
        self._delete_conv_sql = f"DELETE FROM {c} WHERE id = $1 AND {_owned(2)} RETURNING id"
        self._delete_conv_items_sql = f"DELETE FROM {ci} WHERE conversation_id = ANY($1::text[])"
        self._reserve_sql = (f"UPDATE {c} SET next_position = next_position + $2, "
                             f"updated_at = GREATEST(updated_at, $3) WHERE id = $1 AND {_owned(4)} "
                             "RETURNING next_position")
        self._all_conv_items_sql = f"SELECT item FROM {ci} WHERE conversation_id = $1 ORDER BY position"
        self._position_sql = f"SELECT position FROM {ci} WHERE conversation_id = $1 AND item_id = $2"
        self._page_sql = {
            order: f"SELECT item FROM {ci} WHERE conversation_id = $1 AND position {op} $2 "
                   f"ORDER BY position {order.upper()} LIMIT $3"
            for order, op in (("asc", ">"), ("desc", "<"))
        }
        self._get_conv_item_sql = (f"SELECT ci.item FROM {ci} ci JOIN {c} c ON c.id = ci.conversation_id "
                                   f"WHERE ci.conversation_id = $1 AND ci.item_id = $2 AND {_owned(3, 'c.owner')}")
        self._delete_conv_item_sql = f"DELETE FROM {ci} WHERE conversation_id = $1 AND item_id = $2"
        self._sweep_conv_sql = f"DELETE FROM {c} WHERE updated_at < $1 RETURNING id"

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

    async def _migrate(self, conn: _Conn) -> None:
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
        conn, self._listen_conn = self._listen_conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def put(self, record: StoredResponse | None, turn: ConversationTurn | None = None,
                  owner: str | None = None) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            if record is not None:
                await conn.execute(self._put_sql, record.id, record.created_at, record.previous_response_id,
                                   record.status, record.response, record.input_items, record.tool_context,
                                   record.updated_at, record.owner)
                items = _item_rows(record)
                if items:
                    await conn.executemany(self._put_item_sql, items)
            if turn is None:
                return True
            return await self._append(conn, turn.conversation_id, turn.items, turn.updated_at, owner)

    async def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        row = await self.pool.fetchrow(self._get_sql, response_id, owner)
        return None if row is None else _row_to_record(row)

    async def get_chain(self, response_id: str, max_depth: int = DEFAULT_MAX_CHAIN_DEPTH,
                        owner: str | None = None, max_bytes: int | None = None) -> list[StoredResponse]:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        bound = _NO_BOUND if max_bytes is None else max_bytes
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            sizes = await conn.fetch(self._chain_sql, response_id, max_depth, owner, bound)
            ids = chain_sizes(response_id, [(r["id"], r["previous_response_id"], r["total"]) for r in sizes],
                              max_depth, max_bytes)
            if not ids:
                return []
            found = {row["id"]: _row_to_record(row) for row in await conn.fetch(self._chain_rows_sql, ids)}
        missing = [i for i in ids if i not in found]
        if missing:  # cannot happen inside the snapshot; kept as the chain's own error
            raise StoreError(f"response {missing[0]!r} vanished while its chain was read")
        return [found[i] for i in ids]

    async def get_items(self, item_ids: list[str], owner: str | None = None,
                        max_bytes: int | None = None) -> dict[str, dict[str, Any]]:
        ids = list(dict.fromkeys(item_ids))[:1000]
        if not ids:
            return {}
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            where: dict[str, tuple[bool, str, int]] = {}
            for row in await conn.fetch(self._item_sizes_sql, ids, owner):
                where[row["item_id"]] = (False, row["at"], row["size"])
            rest = [i for i in ids if i not in where]
            if rest:  # the latest conversation's copy wins
                for row in await conn.fetch(self._conv_item_sizes_sql, rest, owner):
                    where[row["item_id"]] = (True, row["at"], row["size"])
            check_item_budget(ids, {item_id: w[2] for item_id, w in where.items()}, max_bytes)
            found: dict[str, dict[str, Any]] = {}
            for in_conversation, sql in ((False, self._items_at_sql), (True, self._conv_items_at_sql)):
                at = {w[1]: item_id for item_id, w in where.items() if w[0] is in_conversation}
                if at:
                    for row in await conn.fetch(sql, list(at)):
                        found[at[row["at"]]] = row["item"]
        return found

    async def delete(self, response_id: str, owner: str | None = None) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            if not _count(await conn.execute(self._delete_sql, response_id, owner)):
                return False
            await conn.execute(self._delete_items_sql, response_id)
            await conn.execute(self._delete_events_sql, response_id)
            return True

    async def sweep(self, older_than: int) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._sweep_items_sql, older_than)
            await conn.execute(self._sweep_events_sql, older_than)
            deleted = _count(await conn.execute(self._sweep_sql, older_than))
            # Conversations first (their row locks wait for appends in flight, which bump updated_at), then
            # the items of exactly those.
            ids = [row["id"] for row in await conn.fetch(self._sweep_conv_sql, older_than)]
            if ids:
                await conn.execute(self._delete_conv_items_sql, ids)
            return deleted + len(ids)

    # ------------------------------------------------------------------ background responses
    # Notifications go through NOTIFY on self.channel (payload "<response id> <last seq>" or "<id> cancel"),
    # sent in the writing transaction, so they arrive after the commit, at every replica (this one included).

    async def create_background(self, record: StoredResponse, lease_owner: str, lease_expires_at: float) -> None:
        items = _item_rows(record)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._create_bg_sql, record.id, record.created_at, record.previous_response_id,
                               record.status, record.response, record.input_items, record.tool_context,
                               record.updated_at, record.owner, lease_owner, _ms(lease_expires_at))
            if items:
                await conn.executemany(self._put_item_sql, items)

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        rows = [(response_id, int(e["sequence_number"]), e) for e in events]
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.executemany(self._append_event_sql, rows)
            await conn.execute("SELECT pg_notify($1, $2)", self.channel, f"{response_id} {rows[-1][1]}")

    async def get_events(self, response_id: str, after: int = -1, owner: str | None = None,
                         limit: int = 1000) -> list[dict[str, Any]]:
        return [row["event"] for row in await self.pool.fetch(self._get_events_sql, response_id, after, owner, limit)]

    async def set_status(self, response_id: str, status: str, response: dict[str, Any], *,
                         event: dict[str, Any] | None = None, lease_owner: str | None = None,
                         expired_before: float | None = None) -> bool:
        t = f'"{self.schema}".responses'
        where = f"id = $1 AND background AND {_RUNNING}"
        params: list[Any] = [response_id, status, response, int(time.time())]
        # A lease given up on is nobody's: a replica that was only stalled stops its run at its next renewal.
        clear = ", lease_owner = NULL" if expired_before is not None else ""
        if lease_owner is not None:
            params.append(lease_owner)
            where += f" AND lease_owner = ${len(params)}"
        if expired_before is not None:
            params.append(_ms(expired_before))
            where += f" AND lease_expires_at < ${len(params)}"
        async with self.pool.acquire() as conn, conn.transaction():
            if not _count(await conn.execute(
                    f"UPDATE {t} SET status = $2, response = $3, updated_at = $4{clear} WHERE {where}", *params)):
                return False
            if event is not None:
                seq = int(await conn.fetchval(self._next_seq_sql, response_id))
                event["sequence_number"] = seq
                await conn.execute(self._append_event_sql, response_id, seq, event)
                await conn.execute("SELECT pg_notify($1, $2)", self.channel, f"{response_id} {seq}")
            return True

    async def renew_leases(self, lease_owner: str, response_ids: list[str], lease_expires_at: float) -> list[str]:
        ids = list(dict.fromkeys(response_ids))
        if not ids:
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._renew_sql, ids, lease_owner, _ms(lease_expires_at))
            found = {row["id"]: (row["lease_owner"], row["cancel_requested"])
                     for row in await conn.fetch(self._lease_state_sql, ids)}
        return [i for i in ids if i not in found or found[i][1] or found[i][0] != lease_owner]

    async def request_cancel(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(self._cancel_sql, response_id, owner, int(time.time()))
            if row is not None:
                await conn.execute("SELECT pg_notify($1, $2)", self.channel, f"{response_id} cancel")
            else:
                row = await conn.fetchrow(self._get_sql, response_id, owner)
        return None if row is None else _row_to_record(row)

    async def expired_leases(self, now: float, limit: int = 100) -> list[str]:
        return [row["id"] for row in await self.pool.fetch(self._expired_sql, _ms(now), limit)]

    async def key_material(self) -> bytes:
        table = f'"{self.schema}".gateway_keys'
        # The first replica's insert wins; the others (and every later start) read what it wrote.
        await self.pool.execute(f"INSERT INTO {table} (name, material, created_at) VALUES ('reasoning', $1, $2) "
                                "ON CONFLICT (name) DO NOTHING", os.urandom(32), int(time.time()))
        material = await self.pool.fetchval(f"SELECT material FROM {table} WHERE name = 'reasoning'")
        if not isinstance(material, bytes) or len(material) != 32:
            raise StoreError(f"{table} holds no valid 32-byte 'reasoning' key")
        return material

    async def listen(self) -> None:
        conn = self._listen_conn
        if conn is not None and not conn.is_closed():
            return
        self._listen_conn = None
        # A connection of its own: a pooled one would be handed to other work (and LISTEN lost on release).
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.add_listener(self.channel, self._on_notification)
        except BaseException:
            await conn.close()
            raise
        self._listen_conn = conn

    def _on_notification(self, conn: object, pid: int, channel: str, payload: object) -> None:
        response_id, _, what = str(payload).partition(" ")
        self._notify_local(response_id, what)

    # ------------------------------------------------------------------ conversations

    async def create_conversation(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        c = conversation
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._create_conv_sql, c.id, c.created_at, c.updated_at, c.metadata, c.owner,
                               len(items))
            if items:
                await conn.executemany(self._insert_conv_item_sql,
                                       [(c.id, item["id"], n, item) for n, item in enumerate(items)])

    async def get_conversation(self, conversation_id: str, owner: str | None = None) -> StoredConversation | None:
        row = await self.pool.fetchrow(self._get_conv_sql, conversation_id, owner)
        return None if row is None else _row_to_conversation(row)

    async def update_conversation(self, conversation_id: str, metadata: dict[str, Any], updated_at: int,
                                  owner: str | None = None) -> StoredConversation | None:
        row = await self.pool.fetchrow(self._update_conv_sql, conversation_id, metadata, updated_at, owner)
        return None if row is None else _row_to_conversation(row)

    async def delete_conversation(self, conversation_id: str, owner: str | None = None) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            # The row first: an append in flight holds it, so its items are committed (and seen) before these go.
            if await conn.fetchval(self._delete_conv_sql, conversation_id, owner) is None:
                return False
            await conn.execute(self._delete_conv_items_sql, [conversation_id])
            return True

    async def append_conversation_items(self, conversation_id: str, items: list[dict[str, Any]], updated_at: int,
                                        owner: str | None = None) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            return await self._append(conn, conversation_id, items, updated_at, owner)

    async def _append(self, conn: _Conn, conversation_id: str, items: list[dict[str, Any]],
                      updated_at: int, owner: str | None) -> bool:
        end = await conn.fetchval(self._reserve_sql, conversation_id, len(items), updated_at, owner)
        if end is None:
            return False
        start = int(end) - len(items)
        if items:
            await conn.executemany(self._insert_conv_item_sql,
                                   [(conversation_id, item["id"], start + n, item) for n, item in enumerate(items)])
        return True

    async def get_conversation_items(self, conversation_id: str, owner: str | None = None,
                                     max_bytes: int | None = None) -> list[dict[str, Any]] | None:
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            if await conn.fetchrow(self._get_conv_sql, conversation_id, owner) is None:
                return None
            # Measured in the database before any item is loaded.
            if max_bytes is not None and await conn.fetchval(self._conv_bytes_sql, conversation_id) > max_bytes:
                raise HistoryTooLargeError(max_bytes)
            return [row["item"] for row in await conn.fetch(self._all_conv_items_sql, conversation_id)]

    async def list_conversation_items(self, conversation_id: str, *, limit: int, order: str = "desc",
                                      after: str | None = None, owner: str | None = None
                                      ) -> tuple[list[dict[str, Any]], bool] | None:
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            if await conn.fetchrow(self._get_conv_sql, conversation_id, owner) is None:
                return None
            bound = -1 if order == "asc" else _MAX_POSITION
            if after is not None:
                position = await conn.fetchval(self._position_sql, conversation_id, after)
                if position is None:
                    raise CursorNotFoundError(after)
                bound = int(position)
            rows = await conn.fetch(self._page_sql[order], conversation_id, bound, limit + 1)
        return [row["item"] for row in rows[:limit]], len(rows) > limit

    async def get_conversation_item(self, conversation_id: str, item_id: str, owner: str | None = None
                                    ) -> dict[str, Any] | None:
        return await self.pool.fetchval(self._get_conv_item_sql, conversation_id, item_id, owner)

    async def delete_conversation_item(self, conversation_id: str, item_id: str, updated_at: int,
                                       owner: str | None = None) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            if await conn.fetchval(self._lock_conv_sql, conversation_id, owner) is None:
                return False
            if not _count(await conn.execute(self._delete_conv_item_sql, conversation_id, item_id)):
                return False
            await conn.execute(self._touch_conv_sql, conversation_id, updated_at)
            return True


def _item_rows(record: StoredResponse) -> list[tuple[str, str, dict[str, Any], str]]:
    return [(item_id, record.id, item, record.owner or "") for item_id, item in record_items(record)]


def _count(status: str) -> int:
    # asyncpg returns the command tag, e.g. "DELETE 3".
    return int(status.rsplit(" ", 1)[-1])
