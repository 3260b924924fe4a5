"""Shared test helpers: cassettes, a real gateway on loopback, SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

from gateway.config import Settings
from gateway.protocol.sse import SseParser
from gateway.server import create_app
from gateway.store import ResponseStore
from gateway.upstream.replay import CassetteTransport

ROOT = Path(__file__).resolve().parents[1]
CASSETTES = ROOT / "cassettes"


def cassette(name: str) -> Path:
    for folder in ("vllm", "synthesized"):
        path = CASSETTES / folder / f"{name}.yaml"
        if path.exists():
            return path
    raise FileNotFoundError(name)


def replay(*names: str, **kwargs: Any) -> CassetteTransport:
    return CassetteTransport.from_files(*(cassette(n) for n in names), **kwargs)


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """Parse a client stream, checking the framing: each frame's ``event:`` equals its JSON ``type``."""
    parser = SseParser()
    frames = parser.feed(raw) + parser.close()
    out = []
    for event, data in frames:
        d = orjson.loads(data)
        assert event == d["type"], (event, d["type"])
        out.append(d)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int | None = None) -> Iterator[tuple[str, uvicorn.Server]]:
    """Any ASGI app on loopback in a thread; yields its base URL and the uvicorn server."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2, ws="websockets-sansio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def running_gateway(settings: Settings | None = None, *, transport: httpx.AsyncBaseTransport | None = None,
                    store: ResponseStore | str | None = None, mcp: Any = None, web_search: Any = "from-settings",
                    **overrides: Any) -> Iterator[str]:
    """A real gateway (uvicorn on loopback, in a thread); yields its base URL (``http://127.0.0.1:PORT``).

    The core-path default is ``tool_choice_enforcement="off"``; enforcement tests ask for their mode.
    """
    port = free_port()
    base = settings or Settings(upstream_url="http://upstream.test", store="none", tool_choice_enforcement="off")
    settings = base.with_overrides(host="127.0.0.1", port=port, **overrides)
    with serve_in_thread(create_app(settings, transport=transport, store=store, mcp=mcp,
                                           web_search=web_search), port) as (url, _server):
        yield url


def npm_packages(folder: Path, what: str, *, expect: Path | None = None) -> str:
    """``folder``'s pinned npm packages, installed from its lock file (``npm ci``) when missing or stale; the path
    of ``node``. Missing node/npm or a failed install fails the test (never a skip: these judges run in CI)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        import pytest

        pytest.fail(f"node and npm are required for {what} (they run in CI; install Node.js)")
    marker = folder / "node_modules" / ".package-lock.json"  # npm writes it on every install
    fresh = marker.exists() and marker.stat().st_mtime >= (folder / "package-lock.json").stat().st_mtime
    if not fresh or (expect is not None and not expect.exists()):
        proc = subprocess.run([npm, "ci", "--prefix", str(folder), "--no-audit", "--no-fund"], capture_output=True,
                              text=True, timeout=600, check=False)
        if proc.returncode != 0:
            import pytest

            pytest.fail(f"npm ci in {folder} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return node


@contextlib.contextmanager
def fresh_pg_database(dsn: str) -> Iterator[str]:
    """A new, empty database on ``dsn``'s server for one test, dropped afterwards; yields its DSN.

    Gateway *processes* keep their tables in the ``public`` schema of the database they are given, so tests that
    start them on the shared test database would meet whatever schema version another checkout migrated it to.
    """
    from urllib.parse import urlsplit, urlunsplit

    import asyncpg

    name = "gw_" + __import__("uuid").uuid4().hex[:12]

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    parts = urlsplit(dsn)
    try:
        yield urlunsplit(parts._replace(path="/" + name))
    finally:
        asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
