"""Issue 16, the store's part: history bounded while it is loaded (--max-history-bytes), item ids and sealed
reasoning scoped to their owner, the store written before the terminal event (response.failed / 500 when it
cannot be), one transaction for a response and its conversation turn, range-checked list parameters, private
store files, and stores written by the previous schema migrated in place (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import stat
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from gateway.store import (
    ConversationTurn,
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoredConversation,
    StoredResponse,
    open_store,
)
from gateway.store.base import record_items
from gateway.translate.sealing import ReasoningSealer, parse_keys
from tests.conversation_support import BACKENDS, PG_DSN, fresh_store, require_postgres
from tests.support import replay, running_gateway, sse_events

MIB = 1024 * 1024
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    with fresh_store(request.param, tmp_path) as st:
        yield st


def big(text_id: str, n_bytes: int) -> dict[str, Any]:
    return {"type": "message", "id": text_id, "role": "user",
            "content": [{"type": "input_text", "text": text_id[-1] * n_bytes}]}


def warm_up(url: str, **body: Any) -> httpx.Response:
    """A stored response made without an upstream call (Codex's ``generate: false``)."""
    return httpx.post(url + "/v1/responses", json={"model": "tiny", "generate": False, **body}, timeout=60)


def peak_during(call: Any) -> tuple[Any, int]:
    """``call()``'s result and the peak of Python memory (every thread, the gateway's included) while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = call()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------------- history bounds

def twin(store: ResponseStore) -> ResponseStore:
    """Another (unstarted) store on the same data, for a second gateway."""
    if isinstance(store, SqliteResponseStore):
        return SqliteResponseStore(store.path)
    assert isinstance(store, PostgresResponseStore)
    return PostgresResponseStore(store.dsn, schema=store.schema)


def test_a_chain_over_the_history_bound_is_refused_before_it_is_loaded(store: ResponseStore) -> None:
    bound = 3 * MIB
    second = twin(store)
    with running_gateway(store=store, max_history_bytes=64 * MIB) as url:
        prev = None
        for n in range(10):  # ten 1 MiB turns: 10 MiB of history behind the last one
            r = warm_up(url, input=[big(f"msg_{n}", MIB)], **({"previous_response_id": prev} if prev else {}))
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
    with running_gateway(store=second, max_history_bytes=bound) as url:
        refused, peak = peak_during(lambda: warm_up(url, input="and now?", previous_response_id=prev))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
        assert error["code"] == "history_too_large"
        # Measured in the database: the 10 MiB chain was never read into the process.
        assert peak < bound, peak
        # A chain within the bound still continues.
        short = warm_up(url, input=[big("msg_s", MIB)])
        ok = warm_up(url, input="go on", previous_response_id=short.json()["id"])
        assert ok.status_code == 200, ok.text


def test_a_conversation_and_item_references_over_the_bound_name_their_parameter(store: ResponseStore) -> None:
    with running_gateway(store=store, max_history_bytes=int(2.5 * MIB)) as url:
        conv = httpx.post(url + "/v1/conversations", json={"items": [big(f"msg_c{n}", MIB) for n in range(4)]},
                          timeout=60)
        assert conv.status_code == 200, conv.text
        refused, peak = peak_during(lambda: warm_up(url, input="hi", conversation=conv.json()["id"]))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "conversation", refused.text
        assert peak < 2.5 * MIB, peak
        stored = warm_up(url, input=[big(f"msg_r{n}", MIB) for n in range(4)])
        assert stored.status_code == 200
        refs = [{"type": "message", "role": "user", "content": "see:"}]
        refs += [{"type": "item_reference", "id": f"msg_r{n}"} for n in range(4)]
        refused, peak = peak_during(lambda: warm_up(url, input=refs))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "input[3].id"  # the third megabyte crosses 2.5 MiB
        assert peak < 2.5 * MIB, peak
        assert warm_up(url, input=refs[:3]).status_code == 200  # two referenced megabytes fit
        # The Conversations API's item references are bounded the same way.
        copy = httpx.post(url + "/v1/conversations", json={"items": refs[1:]}, timeout=60)
        assert copy.status_code == 400 and copy.json()["error"]["param"] == "items[2].id", copy.text


# ---------------------------------------------------------------------------- per-owner ids and sealing

def test_each_owner_has_its_own_item_ids(store: ResponseStore) -> None:
    def client(url: str, key: str) -> httpx.Client:
        return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30)

    with running_gateway(store=store, api_keys=(KEY_A, KEY_B)) as url, client(url, KEY_A) as a, \
            client(url, KEY_B) as b:
        mine = {"type": "message", "id": "msg_x", "role": "user", "content": "tenant A's words"}
        theirs = {"type": "message", "id": "msg_x", "role": "user", "content": "tenant B's words"}
        assert a.post("/v1/responses", json={"model": "tiny", "generate": False, "input": [mine]}).status_code == 200
        assert b.post("/v1/responses", json={"model": "tiny", "generate": False, "input": [theirs]}).status_code == 200
        ref = {"model": "tiny", "generate": False, "input": [{"type": "item_reference", "id": "msg_x"}]}
        for who, words in ((a, "tenant A's words"), (b, "tenant B's words")):
            r = who.post("/v1/responses", json=ref)
            assert r.status_code == 200, r.text
            items = who.get(f"/v1/responses/{r.json()['id']}/input_items").json()["data"]
            # listed in the SDK's shape: a string content comes back as one input_text part
            assert [i["content"] for i in items] == [[{"type": "input_text", "text": words}]]


def test_a_blob_sealed_for_one_owner_does_not_open_for_another() -> None:
    sealer = ReasoningSealer(parse_keys(base64.b64encode(os.urandom(32)).decode()), random_bytes=os.urandom)
    item = {"id": "rs_1", "content": [{"type": "reasoning_text", "text": "thought"}]}
    blob = sealer.seal(item, owner="owner-a")
    assert sealer.open(blob, owner="owner-a") == {"id": "rs_1", "text": "thought"}
    assert sealer.open(blob, owner="owner-b") is None and sealer.open(blob) is None
    keyless = sealer.seal(item)  # a gateway without keys: unbound, as blobs were before owners
    assert sealer.open(keyless) == {"id": "rs_1", "text": "thought"} and sealer.open(keyless, "owner-a") is None


def test_sealed_reasoning_of_one_key_is_dropped_and_counted_for_another() -> None:
    from tests.test_reasoning_seal import THOUGHT, Upstream

    up = Upstream()
    key = base64.b64encode(os.urandom(32)).decode()
    turn = {"model": "tiny", "store": False, "stream": True, "include": ["reasoning.encrypted_content"]}
    with running_gateway(transport=httpx.MockTransport(up), reasoning_key=key, api_keys=(KEY_A, KEY_B)) as url:
        def post(api_key: str, body: dict[str, Any]) -> httpx.Response:
            return httpx.post(url + "/v1/responses", json=body, headers={"authorization": f"Bearer {api_key}"},
                              timeout=30)

        reasoning = sse_events(post(KEY_A, {**turn, "input": "patch it"}).content)[-1]["response"]["output"][0]
        replayed = {k: v for k, v in reasoning.items() if k not in ("content", "status")}
        assert post(KEY_B, {**turn, "input": [replayed, {"role": "user", "content": "go"}]}).status_code == 200
        assert post(KEY_A, {**turn, "input": [replayed, {"role": "user", "content": "go"}]}).status_code == 200
        metrics = httpx.get(url + "/metrics").text
    by_b, by_a = up.bodies[1]["input"], up.bodies[2]["input"]
    assert not any(i.get("type") == "reasoning" for i in by_b)  # B got nothing of A's thought
    assert THOUGHT not in str(by_b)
    assert any(i.get("content") == [{"type": "reasoning_text", "text": THOUGHT}] for i in by_a)
    assert "responses_gateway_reasoning_blobs_rejected_total 1.0" in metrics


# ---------------------------------------------------------------------------- store failures, one transaction

class FailingPut(SqliteResponseStore):
    """A real SQLite store whose response writes fail (a full disk, a lost database)."""

    fail = True

    async def put(self, record: StoredResponse | None, turn: ConversationTurn | None = None,
                  owner: str | None = None) -> bool:
        if self.fail:
            raise OSError("disk full")
        return await super().put(record, turn, owner)


def test_a_failed_store_write_is_never_answered_with_an_id(tmp_path: Path) -> None:
    st = FailingPut(tmp_path / "r.db")
    transport = replay("text_completed_stream", "text_completed_nonstream")
    with running_gateway(store=st, transport=transport) as url:
        streamed = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True},
                              timeout=30)
        events = sse_events(streamed.content)
        assert [e["type"] for e in events].count("response.completed") == 0
        last = events[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        assert last["response"]["error"]["code"] == "store_failed"
        assert last["sequence_number"] == events[-2]["sequence_number"] + 1
        plain = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"}, timeout=30)
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "store_failed"
        assert "id" not in plain.json()
        warm = warm_up(url, input="x")
        assert warm.status_code == 500 and warm.json()["error"]["code"] == "store_failed"
        assert httpx.get(url + f"/v1/responses/{last['response']['id']}").status_code == 404


def test_a_background_response_whose_store_write_fails_ends_failed(tmp_path: Path) -> None:
    st = FailingPut(tmp_path / "r.db")
    with running_gateway(store=st) as url:
        queued = warm_up(url, input="hi", background=True, stream=True)
        events = sse_events(queued.content)
        assert events[-1]["type"] == "response.failed", [e["type"] for e in events]
        rid = events[-1]["response"]["id"]
        got = httpx.get(url + f"/v1/responses/{rid}", timeout=30).json()
        assert got["status"] == "failed" and got["error"]["code"] == "store_failed"


def test_the_response_and_its_conversation_turn_commit_together(tmp_path: Path) -> None:
    async def main() -> None:
        st = SqliteResponseStore(tmp_path / "r.db")
        await st.start()
        try:
            await st.create_conversation(StoredConversation("conv_1", 1, 1, {}), [])
            rec = StoredResponse(id="resp_1", created_at=1, previous_response_id=None, status="completed",
                                 response={"id": "resp_1", "output": []}, input_items=[], tool_context=None,
                                 updated_at=1)
            # The turn's second item breaks the write (not JSON-able) after the record and the first item:
            # nothing of either may remain.
            turn = ConversationTurn("conv_1", [{"id": "msg_1"}, {"id": "msg_2", "bad": object()}], 2)
            with pytest.raises(TypeError):
                await st.put(rec, turn)
            assert await st.get("resp_1") is None
            assert await st.get_conversation_items("conv_1") == []
            assert await st.put(rec, ConversationTurn("conv_1", [{"id": "msg_1"}], 2)) is True
            assert await st.get("resp_1") is not None
            assert await st.get_conversation_items("conv_1") == [{"id": "msg_1"}]
            assert await st.put(rec, ConversationTurn("conv_gone", [{"id": "m"}], 3)) is False
        finally:
            await st.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------- list parameters

def test_out_of_range_cursors_and_limits_are_400s(tmp_path: Path) -> None:
    with running_gateway(store=SqliteResponseStore(tmp_path / "r.db")) as url:
        rid = warm_up(url, input="hi", background=True).json()["id"]
        for value in (str(2**63), str(2**64 + 5), "9" * 30, "1_0", "１"):
            r = httpx.get(url + f"/v1/responses/{rid}", params={"stream": "true", "starting_after": value},
                          timeout=30)
            assert r.status_code == 400, (value, r.text)
            assert r.json()["error"]["param"] == "starting_after"
        for value in (str(2**63), "1_0", "１", "0", "101", "-1"):
            r = httpx.get(url + f"/v1/responses/{rid}/input_items", params={"limit": value}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", (value, r.text)
        ok = httpx.get(url + f"/v1/responses/{rid}", params={"stream": "true", "starting_after": str(2**63 - 1)},
                       timeout=30)
        assert ok.status_code == 200


# ---------------------------------------------------------------------------- files

def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_store_files_and_folders_are_private(tmp_path: Path) -> None:
    async def main() -> None:
        old = os.umask(0o022)
        try:
            path = tmp_path / "made" / "here" / "r.db"
            st = open_store(f"sqlite:///{path}")
            assert isinstance(st, SqliteResponseStore)
            await st.start()
            await st.put(StoredResponse(id="resp_1", created_at=1, previous_response_id=None, status="completed",
                                        response={}, input_items=[], tool_context=None, updated_at=1))
            for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                assert mode(f) == 0o600, (f, oct(mode(f)))
            assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
            # Durable commits by default (--sqlite-synchronous full).
            assert st._db is not None and st._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
            await st.close()
            # An older gateway's world-readable files are tightened at start-up.
            for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                if f.exists():
                    os.chmod(f, 0o644)
            normal = open_store(f"sqlite:///{path}", sqlite_synchronous="normal")
            assert isinstance(normal, SqliteResponseStore)
            await normal.start()
            assert normal._db is not None and normal._db.execute("PRAGMA synchronous").fetchone()[0] == 1
            for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                if f.exists():
                    assert mode(f) == 0o600, (f, oct(mode(f)))
            await normal.close()
        finally:
            os.umask(old)

    asyncio.run(main())


# ---------------------------------------------------------------------------- migration from main's schema
#
# The database today's main writes: its migrations (append-only, so MIGRATIONS[:4] here are exactly main's) and
# rows written with main's own statements, copied below.

OLD_VERSION = 4
OLD_PUT_ITEM = {
    "sqlite": "INSERT INTO response_items (item_id, response_id, item, owner) VALUES (?, ?, ?, ?) "
              "ON CONFLICT (item_id) DO UPDATE SET response_id = excluded.response_id, item = excluded.item "
              "WHERE response_items.owner IS excluded.owner",
    "postgres": "INSERT INTO {s}.response_items (item_id, response_id, item, owner) VALUES ($1, $2, $3::jsonb, $4) "
                "ON CONFLICT (item_id) DO UPDATE SET response_id = EXCLUDED.response_id, item = EXCLUDED.item "
                "WHERE {s}.response_items.owner IS NOT DISTINCT FROM EXCLUDED.owner",
}


def old_rows() -> list[StoredResponse]:
    def rec(rid: str, owner: str | None, text: str, created: int, prev: str | None = None) -> StoredResponse:
        item = {"type": "message", "id": "msg_shared", "role": "user", "content": text}
        out = {"type": "message", "id": f"msg_out_{rid}", "role": "assistant", "content": []}
        return StoredResponse(id=rid, created_at=created, previous_response_id=prev, status="completed",
                              response={"id": rid, "output": [out]}, input_items=[item], tool_context=None,
                              updated_at=created, owner=owner)

    return [rec("resp_a1", "owner-a", "A first", 10), rec("resp_b1", "owner-b", "B's own", 11),
            rec("resp_a2", "owner-a", "A again", 12, prev="resp_a1"), rec("resp_n1", None, "keyless", 13)]


def old_params(row: StoredResponse) -> tuple[Any, ...]:
    return (row.id, row.created_at, row.previous_response_id, row.status, orjson.dumps(row.response).decode(),
            orjson.dumps(row.input_items).decode(), None, row.updated_at, row.owner)


CONV_ITEM = {"type": "message", "id": "msg_c", "role": "user", "content": "c"}


async def check_migrated(new: ResponseStore, rows: list[StoredResponse]) -> None:
    for row in rows:  # every record intact
        assert await new.get(row.id) == row
    chain = await new.get_chain("resp_a2", owner="owner-a")
    assert [r.id for r in chain] == ["resp_a1", "resp_a2"]
    # B's msg_shared was lost to A's under the old global uniqueness; the migration brings it back from B's
    # response. A's is A's latest write, a keyless row is still found without an owner.
    assert (await new.get_items(["msg_shared"], owner="owner-b"))["msg_shared"]["content"] == "B's own"
    assert (await new.get_items(["msg_shared"], owner="owner-a"))["msg_shared"]["content"] == "A again"
    assert "msg_out_resp_n1" in await new.get_items(["msg_out_resp_n1"])
    assert await new.get_conversation_items("conv_old", owner="owner-a") == [CONV_ITEM]
    # And now one id per owner: a new owner's write takes nobody's.
    third = StoredResponse(id="resp_c1", created_at=20, previous_response_id=None, status="completed",
                           response={"id": "resp_c1", "output": []},
                           input_items=[{"type": "message", "id": "msg_shared", "content": "C"}], tool_context=None,
                           updated_at=20, owner="owner-c")
    await new.put(third)
    assert (await new.get_items(["msg_shared"], owner="owner-c"))["msg_shared"]["content"] == "C"
    assert (await new.get_items(["msg_shared"], owner="owner-b"))["msg_shared"]["content"] == "B's own"


def test_a_sqlite_store_written_by_main_is_migrated_in_place(tmp_path: Path) -> None:
    from gateway.store.sqlite import MIGRATIONS

    path = tmp_path / "old.db"
    old = os.umask(0o022)
    try:
        db = sqlite3.connect(path, isolation_level=None)
    finally:
        os.umask(old)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)")
    for statements in MIGRATIONS[:OLD_VERSION]:
        for statement in statements:
            db.execute(statement)
    db.execute("INSERT INTO schema_version VALUES (1, ?)", (OLD_VERSION,))
    for row in old_rows():
        db.execute("INSERT INTO responses (id, created_at, previous_response_id, status, response, input_items, "
                   "tool_context, updated_at, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", old_params(row))
        for item_id, item in record_items(row):
            db.execute(OLD_PUT_ITEM["sqlite"], (item_id, row.id, orjson.dumps(item).decode(), row.owner))
    db.execute("INSERT INTO conversations (id, owner, created_at, updated_at, metadata, next_position) "
               "VALUES ('conv_old', 'owner-a', 1, 1, '{}', 1)")
    db.execute("INSERT INTO conversation_items VALUES ('conv_old', 'msg_c', 0, ?)", (orjson.dumps(CONV_ITEM).decode(),))
    # Main's global uniqueness: B's msg_shared was never stored.
    assert db.execute("SELECT count(*) FROM response_items WHERE item_id = 'msg_shared'").fetchone()[0] == 1
    db.close()
    assert mode(path) == 0o644

    async def main() -> None:
        new = SqliteResponseStore(path)
        await new.start()
        try:
            await check_migrated(new, old_rows())
        finally:
            await new.close()

    asyncio.run(main())
    assert mode(path) == 0o600


def test_a_postgres_store_written_by_main_is_migrated_in_place() -> None:
    from gateway.store.postgres import MIGRATIONS

    require_postgres()
    schema = "migr_" + uuid.uuid4().hex[:12]
    s = f'"{schema}"'

    async def main() -> None:
        conn = await asyncpg.connect(PG_DSN)
        try:
            await conn.execute(f"CREATE SCHEMA {s}")
            await conn.execute(f"CREATE TABLE {s}.schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), "
                               "version INTEGER NOT NULL)")
            for statements in MIGRATIONS[:OLD_VERSION]:
                for statement in statements:
                    await conn.execute(statement.format(s=s))
            await conn.execute(f"INSERT INTO {s}.schema_version VALUES (1, {OLD_VERSION})")
            for row in old_rows():
                await conn.execute(
                    f"INSERT INTO {s}.responses (id, created_at, previous_response_id, status, response, input_items, "
                    "tool_context, updated_at, owner) VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7::jsonb, $8, $9)",
                    *old_params(row))
                for item_id, item in record_items(row):
                    await conn.execute(OLD_PUT_ITEM["postgres"].format(s=s), item_id, row.id,
                                       orjson.dumps(item).decode(), row.owner)
            await conn.execute(f"INSERT INTO {s}.conversations (id, owner, created_at, updated_at, metadata, "
                               "next_position) VALUES ('conv_old', 'owner-a', 1, 1, '{}', 1)")
            await conn.execute(f"INSERT INTO {s}.conversation_items VALUES ('conv_old', 'msg_c', 0, $1::jsonb)",
                               orjson.dumps(CONV_ITEM).decode())
            assert await conn.fetchval(f"SELECT count(*) FROM {s}.response_items WHERE item_id = 'msg_shared'") == 1
        finally:
            await conn.close()
        new = PostgresResponseStore(PG_DSN, schema=schema)
        await new.start()
        try:
            await check_migrated(new, old_rows())
        finally:
            await new.close()

    async def drop() -> None:
        conn = await asyncpg.connect(PG_DSN)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
        finally:
            await conn.close()

    try:
        asyncio.run(main())
    finally:
        asyncio.run(drop())
