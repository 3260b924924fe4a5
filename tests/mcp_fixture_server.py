"""A real MCP server for the gateway's MCP tests, built with the official SDK (``MCPServer``, mcp 2's FastMCP).

Run as a subprocess by ``tests/mcp_servers.py``::

    python -m tests.mcp_fixture_server --transport streamable-http|sse --fd N

``--fd`` is a listening TCP socket the parent bound on a free loopback port and passed down, so there is no
pick-a-port-then-bind race. ``--port`` (bind it here) works too, for running it by hand.

Tools: ``add``, ``echo``, ``fail`` (raises: an ``isError`` result), ``sleep``, ``structured`` (structured
content only, no text block), ``big`` (a long text), ``protocol_error`` (a JSON-RPC error response).
Every tool call is recorded with the HTTP request headers it came with; ``GET /_calls`` returns the records as
JSON so tests can check that credentials reached the server. ``/status/{code}`` answers every request with
that HTTP status, to test how the client reports HTTP failures. Over SSE the endpoint is ``/sse`` and also
``/events``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

CALLS: list[dict[str, Any]] = []

server = MCPServer(name="gateway-fixture", version="1.0.0")


def _record(ctx: Context, tool: str, arguments: dict[str, Any]) -> None:
    headers = {k.lower(): v for k, v in (ctx.headers or {}).items()}
    CALLS.append({"tool": tool, "arguments": arguments, "headers": headers})


@server.tool()
def add(a: int, b: int, ctx: Context) -> int:
    """Add two integers."""
    _record(ctx, "add", {"a": a, "b": b})
    return a + b


@server.tool()
def echo(text: str, ctx: Context) -> str:
    """Return the text unchanged."""
    _record(ctx, "echo", {"text": text})
    return text


@server.tool()
def fail(message: str, ctx: Context) -> str:
    """Always raise: the SDK turns it into a result with isError=true."""
    _record(ctx, "fail", {"message": message})
    raise ValueError(message)


@server.tool()
async def sleep(seconds: float, ctx: Context) -> str:
    """Sleep, then say so (for timeouts)."""
    _record(ctx, "sleep", {"seconds": seconds})
    await anyio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def structured(ctx: Context) -> CallToolResult:
    """Structured content and no text block."""
    _record(ctx, "structured", {})
    return CallToolResult(content=[], structured_content={"temperature": 21.5, "unit": "C", "tags": ["a", "b"]})


@server.tool()
def big(size: int, ctx: Context) -> str:
    """A text of `size` characters."""
    _record(ctx, "big", {"size": size})
    return "x" * size


@server.tool()
def protocol_error(ctx: Context) -> str:
    """Answer with a JSON-RPC error instead of a tool result."""
    _record(ctx, "protocol_error", {})
    raise MCPError(code=-32602, message="protocol_error was asked to fail")


async def calls(_: Request) -> Response:
    return JSONResponse(CALLS)


async def status(request: Request) -> Response:
    return Response(f"status {request.path_params['code']}", status_code=request.path_params["code"])


server.custom_route("/_calls", methods=["GET"])(calls)
server.custom_route("/status/{code:int}", methods=["GET", "POST", "DELETE"])(status)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["streamable-http", "sse"], default="streamable-http")
    parser.add_argument("--fd", type=int, default=None, help="an inherited listening socket")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    # The SDK's DNS-rebinding protection, plus mcp.test: the gateway's address tests reach this server under that
    # name through a resolver of their own (the connection goes to the address the check saw).
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*", "mcp.test:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
    if args.transport == "streamable-http":
        app = server.streamable_http_app(transport_security=security)
    else:
        app = server.sse_app(transport_security=security)
        # The same SSE endpoint under a path that does not end in /sse, so a client has to discover the
        # transport (POST answered 405, then GET as SSE) instead of guessing it from the URL.
        sse_route = next(r for r in app.routes if isinstance(r, Route) and r.path == "/sse")
        app.router.routes.append(Route("/events", endpoint=sse_route.endpoint, methods=["GET"]))
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.create_server(("127.0.0.1", args.port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
