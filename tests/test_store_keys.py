"""The store's own key (``ResponseStore.key_material``): made once, the same for every process and replica sharing
the store, kept private."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from pathlib import Path

import pytest

from gateway.config import Settings
from gateway.server.keys import with_reasoning_key
from gateway.store import PostgresResponseStore, SqliteResponseStore, StoreError
from tests.test_store import PG_DSN, drop_schema, require_postgres


async def test_sqlite_key_is_made_once_beside_the_database_0600_and_shared(tmp_path: Path) -> None:
    path = tmp_path / "data" / "responses.db"
    stores = [SqliteResponseStore(path) for _ in range(3)]  # three workers starting at once
    for st in stores:
        await st.start()
    try:
        keys = await asyncio.gather(*(st.key_material() for st in stores))
        assert len(set(keys)) == 1 and len(keys[0]) == 32
        key_file = tmp_path / "data" / "responses.db.key"
        assert stats_mode(key_file) == 0o600
        assert [p.name for p in key_file.parent.iterdir() if p.name.endswith(".tmp")] == []
        os.chmod(key_file, 0o644)  # loosened by hand: tightened again on the next read
        assert await stores[0].key_material() == keys[0] and stats_mode(key_file) == 0o600
        settings = await with_reasoning_key(Settings(store="sqlite:///x"), stores[1])
        assert settings.reasoning_key is not None
        configured = Settings(reasoning_key="configured")
        assert await with_reasoning_key(configured, stores[1]) is configured  # --reasoning-key wins
        key_file.write_text("not base64!\n")
        with pytest.raises(StoreError):
            await stores[2].key_material()
    finally:
        for st in stores:
            await st.close()


def stats_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_without_a_store_the_key_is_per_start() -> None:
    one = await with_reasoning_key(Settings(store="none"), None)
    two = await with_reasoning_key(Settings(store="none"), None)
    assert one.reasoning_key and two.reasoning_key and one.reasoning_key != two.reasoning_key


@pytest.mark.postgres
async def test_postgres_key_is_one_row_shared_by_every_replica() -> None:
    await require_postgres()
    schema = f"test_keys_{uuid.uuid4().hex[:12]}"
    stores = [PostgresResponseStore(PG_DSN, schema=schema) for _ in range(3)]
    try:
        for st in stores:
            await st.start()
        keys = await asyncio.gather(*(st.key_material() for st in stores))
        assert len(set(keys)) == 1 and len(keys[0]) == 32
        await stores[0].close()
        again = PostgresResponseStore(PG_DSN, schema=schema)  # a restart
        await again.start()
        assert await again.key_material() == keys[0]
        await again.close()
    finally:
        for st in stores[1:]:
            await st.close()
        await drop_schema(schema)
