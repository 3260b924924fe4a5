"""Real MCP servers for the tests, as session-scoped pytest fixtures (use ``pytest_plugins = ["tests.mcp_servers"]``).

- ``mcp_fixture_server``: ``tests/mcp_fixture_server.py`` (the official Python SDK's ``MCPServer``) over
  streamable HTTP, at ``<base>/mcp``; it records each tool call with its request headers (``calls()``).
- ``mcp_sse_server``: the same server over the older HTTP+SSE transport only, at ``<base>/sse`` (and
  ``<base>/events``, a path a client cannot recognise as SSE).
- ``mcp_everything_server``: the reference server ``@modelcontextprotocol/server-everything`` (TypeScript SDK),
  pinned in ``tests/mcp_everything/package.json`` + ``package-lock.json``, run as
  ``node dist/index.js streamableHttp`` with ``PORT=<port>``, at ``<base>/mcp``. ``node`` and ``npm`` are
  required: without them the fixture fails rather than skips, so CI runs it.

Each server runs as a subprocess on a free loopback port and is stopped at the end of the session.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from tests.support import npm_packages

ROOT = Path(__file__).resolve().parents[1]
EVERYTHING = ROOT / "tests" / "mcp_everything"
EVERYTHING_MAIN = EVERYTHING / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
START_TIMEOUT = 20.0


@dataclass
class McpTestServer:
    """A running MCP server subprocess."""

    base_url: str
    url: str  # the MCP endpoint
    process: subprocess.Popen[bytes]
    log: IO[bytes] = field(repr=False)

    def calls(self) -> list[dict[str, Any]]:
        """What the fixture server recorded: ``[{"tool", "arguments", "headers"}]`` (fixture server only)."""
        response = httpx.get(self.base_url + "/_calls", timeout=5)
        response.raise_for_status()
        calls: list[dict[str, Any]] = response.json()
        return calls

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def _wait_ready(server: McpTestServer, probe: str) -> None:
    """Poll ``probe`` until the server answers anything over HTTP; fail with its output if it dies."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"MCP test server exited ({server.process.returncode}):\n{server.output()}")
        try:
            httpx.get(server.base_url + probe, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    server.stop()
    pytest.fail(f"MCP test server did not start within {START_TIMEOUT}s:\n{server.output()}")


def start_fixture_server(transport: str = "streamable-http", port: int | None = None) -> McpTestServer:
    """Start ``tests/mcp_fixture_server.py``. Without ``port``, on a socket bound here and inherited (no race)."""
    log = tempfile.NamedTemporaryFile(prefix="mcp-fixture-", suffix=".log", delete=False)
    if port is None:
        sock = socket.create_server(("127.0.0.1", 0))
        port_args = ["--fd", str(sock.fileno())]
        pass_fds: tuple[int, ...] = (sock.fileno(),)
    else:
        sock = None
        port_args, pass_fds = ["--port", str(port)], ()
    try:
        bound = port if sock is None else sock.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.mcp_fixture_server", "--transport", transport, *port_args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds,
        )
    finally:
        if sock is not None:
            sock.close()  # the child holds its own copy
    base = f"http://127.0.0.1:{bound}"
    server = McpTestServer(base, base + ("/mcp" if transport == "streamable-http" else "/sse"), process, log)
    _wait_ready(server, "/_calls")
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_everything_server() -> McpTestServer:
    node = npm_packages(EVERYTHING, "the MCP reference-server tests", expect=EVERYTHING_MAIN)
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="mcp-everything-", suffix=".log", delete=False)
    process = subprocess.Popen([node, str(EVERYTHING_MAIN), "streamableHttp"], cwd=EVERYTHING, stdout=log,
                               stderr=subprocess.STDOUT, env={**os.environ, "PORT": str(port)})
    base = f"http://127.0.0.1:{port}"
    server = McpTestServer(base, base + "/mcp", process, log)
    _wait_ready(server, "/mcp")  # a GET without a session is answered 400: good enough to know it listens
    return server


@pytest.fixture(scope="session")
def mcp_fixture_server() -> Iterator[McpTestServer]:
    server = start_fixture_server("streamable-http")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mcp_sse_server() -> Iterator[McpTestServer]:
    server = start_fixture_server("sse")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mcp_everything_server() -> Iterator[McpTestServer]:
    server = start_everything_server()
    yield server
    server.stop()
