"""Shared test helpers: cassettes, a real gateway on loopback, SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
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
def running_gateway(settings: Settings | None = None, *, transport: httpx.AsyncBaseTransport | None = None,
                    store: ResponseStore | str | None = None, **overrides: Any) -> Iterator[str]:
    """A real uvicorn server on loopback, in a thread; yields its base URL (``http://127.0.0.1:PORT``)."""
    port = free_port()
    # Replayed /v1/responses cassettes are the core path: enforcement (default constrain, which talks to
    # /v1/chat/completions for pinned calls) is opted into by the tests that exercise it.
    base = settings or Settings(upstream_url="http://upstream.test", store="none", tool_choice_enforcement="off")
    settings = base.with_overrides(host="127.0.0.1", port=port, **overrides)
    app = create_app(settings, transport=transport, store=store)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
