"""Helpers shared by the conversation and ownership tests: a fresh store per backend, a renumbering upstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from gateway.store import PostgresResponseStore, ResponseStore, SqliteResponseStore

PG_DSN = os.environ.get("GATEWAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


async def _pg(sql: str) -> None:
    conn = await asyncpg.connect(PG_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def require_postgres() -> None:
    """Fail (not skip) when PostgreSQL is down, unless GATEWAY_TEST_SKIP_POSTGRES=1 says to skip."""
    try:
        asyncio.run(_pg("SELECT 1"))
    except Exception as exc:
        if os.environ.get("GATEWAY_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"PostgreSQL unavailable: {exc!r}")
        pytest.fail(f"PostgreSQL at {PG_DSN} did not answer ({exc!r}); .ci/run starts one.", pytrace=False)


@contextlib.contextmanager
def fresh_store(backend: str, tmp_path: Path) -> Iterator[ResponseStore]:
    """A new, not yet started store (the gateway's lifespan starts and closes it); a PostgreSQL one lives in
    its own schema, dropped afterwards."""
    if backend == "sqlite":
        yield SqliteResponseStore(tmp_path / "r.db")
        return
    require_postgres()
    schema = "conv_" + uuid.uuid4().hex[:12]
    try:
        yield PostgresResponseStore(PG_DSN, schema=schema)
    finally:
        asyncio.run(_pg(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


class Renumbered(httpx.AsyncBaseTransport):
    """Replays one recorded answer for every request, each with its own output item id (``msg_turn0000``,
    …, numbered in arrival order) and after ``delays[n]`` seconds, so concurrent turns finish in a known order."""

    def __init__(self, inner: httpx.AsyncBaseTransport, item_id: str, delays: Sequence[float] = ()) -> None:
        self.inner = inner
        self.item_id = item_id.encode()
        self.delays = list(delays)
        self.calls = 0
        self.finished: list[str] = []
        self.bodies: dict[str, Any] = {}  # the upstream request body, by the output id it was answered with

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self.inner.requests  # type: ignore[attr-defined, no-any-return]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        n = self.calls
        self.calls += 1
        new_id = f"msg_turn{n:04d}"
        self.bodies[new_id] = json.loads(await request.aread())
        resp = await self.inner.handle_async_request(request)
        body = b"".join([chunk async for chunk in resp.stream])  # type: ignore[union-attr]
        await asyncio.sleep(self.delays[n] if n < len(self.delays) else 0)
        self.finished.append(new_id)
        return httpx.Response(resp.status_code, headers=resp.headers,
                              stream=httpx.ByteStream(body.replace(self.item_id, new_id.encode())))


def sdk(url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
