"""PostgreSQL's JSONB cannot hold U+0000: the store keeps the response, with U+FFFD in its place."""

from __future__ import annotations

import asyncio
import os
import uuid

import orjson
import pytest

from gateway.store import PostgresResponseStore, StoredResponse
from gateway.store.postgres import _encode_jsonb

PG_DSN = os.environ.get("GATEWAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.mark.parametrize("value,expected", [("x\x00y", "x\ufffdy"), ("lit\\u0000", "lit\\u0000"),
                                            ("a\\\x00", "a\\\ufffd"), ({"k\x00": ["\x00"]}, {"k\ufffd": ["\ufffd"]})])
def test_nul_is_replaced_only_where_it_is_a_character(value: object, expected: object) -> None:
    assert orjson.loads(_encode_jsonb(value)) == expected


@pytest.mark.postgres
def test_a_response_with_nul_is_stored_in_postgres() -> None:
    async def run() -> StoredResponse | None:
        store = PostgresResponseStore(PG_DSN, schema="nul_" + uuid.uuid4().hex[:8])
        await store.start()
        try:
            await store.put(StoredResponse(id="resp_nul", created_at=1, previous_response_id=None, status="completed",
                                           response={"output": [{"text": "a\x00b"}]}, input_items=[],
                                           tool_context=None, updated_at=1))
            return await store.get("resp_nul")
        finally:
            import asyncpg

            conn = await asyncpg.connect(PG_DSN)
            await conn.execute(f'DROP SCHEMA IF EXISTS "{store.schema}" CASCADE')
            await conn.close()
            await store.close()

    got = asyncio.run(run())
    assert got is not None and got.response["output"][0]["text"] == "a\ufffdb"
