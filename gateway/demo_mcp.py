"""The demo's built-in MCP server (``responses-gateway demo``): a few harmless tools over streamable HTTP, so a
newcomer can run a gateway-executed MCP round trip with no GPU and no server of their own.

It is an MCP server of the official SDK (``MCPServer``), served by uvicorn on a loopback port in a thread of
the demo process; the demo's servers file lists it under the label ``demo`` (no approval), so clients declare
``{"type": "mcp", "server_label": "demo"}`` alone.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["start_demo_mcp"]


def _server() -> MCPServer:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(name="responses-gateway-demo", version="1.0.0")

    # Defaults everywhere: the demo's recorded model calls tools with empty arguments.
    @server.tool()
    def add(a: int = 2, b: int = 3) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def echo(text: str = "hello from the demo MCP server") -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def utc_time() -> str:
        """The current UTC time, ISO 8601."""
        return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    return server


def start_demo_mcp(host: str = "127.0.0.1") -> str:
    """Start the server in a daemon thread; its streamable-HTTP URL."""
    import uvicorn

    app = _server().streamable_http_app()
    sock = socket.create_server((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    # the gateway owns the signals: uvicorn installs none off the main thread (Server.capture_signals)
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True,
                     name="demo-mcp").start()
    return f"http://{host}:{port}/mcp"
